"""Groups span shards and ranks: a 2-rank gloo run and a 2-rank mpirun give the one-process result."""

import os
import shutil
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow.compute as pc
import pytest

from agent_r1.records.reader import RecordStore

RANK_SCRIPT = textwrap.dedent(
    """
    import sys, numpy as np, torch, torch.distributed as dist
    from agent_r1.algos.advantages import AdvantageConfig, compute_advantages
    from agent_r1.algos.reduce import TorchReducer
    from agent_r1.learner.step_inputs import to_step_inputs
    from agent_r1.records.reader import RecordStore
    rank, world, port, records, estimator, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    t = RecordStore(records).read(0, rank=rank, world=world, by="shard")
    b = to_step_inputs(t, anchors=estimator == "gigpo")
    a = compute_advantages(estimator, b.inputs, AdvantageConfig(gamma=0.95, lam=0.9), TorchReducer())
    np.savez(out, tid=np.array(b.table.column("trajectory_id").to_pylist()), step=b.table.column("step_index").to_numpy(), adv=a.step_adv.numpy())
    dist.destroy_process_group()
    """
)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _synth(tmp_path, n=300):
    d = tmp_path / "records"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "agent_r1.cli",
            "records",
            "synth",
            "--trajectories",
            str(n),
            "--group-size",
            "4",
            "--writers",
            "5",
            "--seed",
            "3",
            "--out",
            str(d),
        ],
        check=True,
        capture_output=True,
    )
    return d


def _by_key(tid, step, adv):
    return {(t, int(s)): float(a) for t, s, a in zip(tid, step, adv, strict=True)}


@pytest.mark.parametrize("estimator", ["grpo", "gae", "gigpo", "rloo"])
def test_two_rank_gloo_equals_one_process(tmp_path, estimator):
    records = _synth(tmp_path)
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def run(world):
        port = str(_port())
        outs = [tmp_path / f"{estimator}_{world}_{r}.npz" for r in range(world)]
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    str(script),
                    str(r),
                    str(world),
                    port,
                    str(records),
                    estimator,
                    str(outs[r]),
                ],
                env=env,
            )
            for r in range(world)
        ]
        assert all(p.wait(timeout=120) == 0 for p in procs)
        res = {}
        for o in outs:
            z = np.load(o)
            res.update(_by_key(z["tid"], z["step"], z["adv"]))
        return res

    one, two = run(1), run(2)
    assert one.keys() == two.keys() and len(one) > 500
    assert max(abs(one[k] - two[k]) for k in one) < 1e-6


@pytest.mark.skipif(
    shutil.which("mpirun") is None, reason="Open MPI not installed (tools/install.sh installs it)"
)
@pytest.mark.parametrize("estimator", ["grpo", "gae", "token_gae"])
def test_two_rank_mpirun_cli_equals_one_process(tmp_path, estimator):
    records = _synth(tmp_path, n=200)
    cli = [
        sys.executable,
        "-m",
        "agent_r1.cli",
        "records",
        "advantages",
        str(records),
        "--estimator",
        estimator,
        "--gamma",
        "0.9",
    ]
    subprocess.run([*cli, "--out", str(tmp_path / "one")], check=True, capture_output=True)
    env = {
        **os.environ,
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "OMP_NUM_THREADS": "1",
    }
    res = subprocess.run(
        ["mpirun", "--oversubscribe", "-n", "2", *cli, "--out", str(tmp_path / "two")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "r1/2" in res.stdout  # really two ranks

    def load(d):
        t = RecordStore(d).read(0)
        t = t.take(pc.sort_indices(t, [("trajectory_id", "ascending"), ("step_index", "ascending")]))
        col = "advantage" if estimator != "token_gae" else "token_advantages"
        v = t.column(col).to_pylist()
        return t.column("trajectory_id").to_pylist(), v

    ids1, a1 = load(tmp_path / "one")
    ids2, a2 = load(tmp_path / "two")
    assert ids1 == ids2
    flat1 = np.array(a1 if estimator != "token_gae" else [x for row in a1 for x in row])
    flat2 = np.array(a2 if estimator != "token_gae" else [x for row in a2 for x in row])
    np.testing.assert_allclose(flat1, flat2, atol=1e-6)
    assert RecordStore(tmp_path / "two").manifest(0)["rows"] == RecordStore(records).manifest(0)["rows"]
