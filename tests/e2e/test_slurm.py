"""Slurm-native launch against a real local cluster (tools/local_slurm.sh: slurmctld + two slurmd,
nodes n1 = 127.0.1.1 and n2 = 127.0.1.2 on this host), started for this module and stopped after.

`launch --dry-run` of a GPU preset checked field by field; a 2-node het job (learner on n1, rollout
roles on n2); a job array sweep with its report; `scontrol requeue` of a running job resumes with
no record lost or trained twice; mpi4py `records advantages` under `srun --mpi=pmix` on 2 nodes
equals the one-process result.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pytest
from omegaconf import OmegaConf
from train_checks import check_events, check_finished, ledger, manifest, reduced

from agent_r1.records.reader import RecordStore

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "local_slurm.sh"


def sh(args: list[str], env: dict, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"{args} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return r


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """SLURM_CONF environment of a fresh 2-node cluster (installed with apt when missing)."""
    if os.geteuid() != 0:
        pytest.skip("the local Slurm cluster needs root (apt-get, slurmd)")
    base = tmp_path_factory.mktemp("slurm")
    os.chmod(base, 0o755)
    env = {**os.environ, "LOCAL_SLURM_PORT": "18817", "LOCAL_SLURM_CPUS": "2"}
    env = {k: v for k, v in env.items() if not k.startswith("SLURM_")}
    try:
        sh(["bash", str(SCRIPT), "start", str(base)], env, timeout=600)
        env["SLURM_CONF"] = str(base / "etc" / "slurm.conf")
        yield env
    finally:
        subprocess.run(["bash", str(SCRIPT), "stop", str(base)], env=env, capture_output=True, timeout=120)


def agent_r1(args: list[str], env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    return sh([sys.executable, "-m", "agent_r1.cli", *args], env, timeout)


def wait_job(job: str, env: dict, timeout: float = 400) -> list[str]:
    """Until the job (all components / array tasks) leaves the queue; its final states."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not sh(["squeue", "-h", "-j", job], env, check=False).stdout.strip():
            break
        time.sleep(0.5)
    else:
        sh(["scancel", job], env, check=False)
        raise AssertionError(f"job {job} still queued after {timeout} s")
    out = sh(["scontrol", "show", "job", job], env, check=False).stdout
    return re.findall(r"JobState=(\w+)", out)


def submitted_id(stdout: str) -> str:
    m = re.search(r"submitted job(?: array)? (\d+)", stdout)
    assert m, stdout
    return m.group(1)


def test_local_slurm_status(slurm):
    out = sh(["bash", str(SCRIPT), "status", str(Path(slurm["SLURM_CONF"]).parents[1])], slurm).stdout
    assert "slurmctld: running" in out and "slurmd-n1: running" in out and "slurmd-n2: running" in out
    assert re.search(r"debug\*\s+up\s+\S+\s+2\s+idle\s+n\[1-2\]", out)


def test_launch_dry_run_gpu_preset_field_by_field(tmp_path):
    run = tmp_path / "q4b"
    r = agent_r1(
        [
            "launch",
            "+experiment=qwen3_4b_gsm8k_tool_steppo_4n8g",
            f"trainer.run_dir={run}",
            "cluster.account=rl",
            "cluster.qos=high",
            "cluster.network_interface=ib0",
            "cluster.container_image='nvcr.io#nvidia/pytorch:25.01-py3'",
            "cluster.container_mounts=['/shared:/shared']",
            "--dry-run",
        ],
        dict(os.environ),
    )
    script = r.stdout
    assert not run.exists()  # a dry run creates nothing
    head, _, rest = script.partition("#SBATCH hetjob\n")
    learner = re.findall(r"^#SBATCH (\S+)$", head, re.M)
    rollout = re.findall(r"^#SBATCH (\S+)$", rest, re.M)
    assert learner == [
        "--job-name=agent-r1-qwen3_4b_gsm8k_tool_steppo_4n8g",
        "--time=24:00:00",
        "--partition=gpu",
        "--account=rl",
        "--qos=high",
        f"--output={run}/logs/slurm-%j.out",
        "--open-mode=append",
        "--requeue",
        "--signal=B:USR1@300",
        "--nodes=4",
        "--ntasks-per-node=8",  # one learner rank per GPU: 32 = TP2 x PP2 x DP8
        "--cpus-per-task=8",
        "--gpus-per-node=8",
        "--mem=0",
    ]
    assert rollout == [
        "--nodes=2",
        "--ntasks-per-node=9",
        "--cpus-per-task=8",
        "--gpus-per-node=8",
        "--mem=0",
    ]
    sruns = [line for line in script.splitlines() if line.startswith("srun ")]
    assert len(sruns) == 3
    server, worker, learner_step = sruns
    for line, group, n, nodes, role in (
        (server, 1, 16, 2, "server"),
        (worker, 1, 2, 2, "worker"),
        (learner_step, 0, 32, 4, "learner"),
    ):
        assert f"--het-group={group} " in line and f"--ntasks={n} " in line and f"--nodes={nodes} " in line
        assert f"role {role} --run-dir {run}" in line
        assert "--container-image=nvcr.io#nvidia/pytorch:25.01-py3" in line
        assert "--container-mounts=/shared:/shared" in line
    assert "--gpus-per-task=1" in server and "--gpus-per-task=1" in learner_step
    assert "--gpus-per-task=1" not in worker
    assert "export NCCL_SOCKET_IFNAME=ib0 GLOO_SOCKET_IFNAME=ib0" in script
    assert "source .venv/bin/activate" in script  # cluster.setup
    assert "trap 'REQUEUE=1; stop_run USR1' USR1" in script  # the time-limit warning -> checkpoint
    assert 'sbatch --parsable --dependency=afterany:$SLURM_JOB_ID "$RUN_DIR/job.sbatch"' in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0  # valid shell


def test_launch_rejects_bad_layout(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "agent_r1.cli",
            "launch",
            "+experiment=qwen3_4b_gsm8k_tool_steppo_4n8g",
            "cluster.gpus_per_node=4",
            "--dry-run",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "cluster.gpus_per_node" in r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "agent_r1.cli", "launch", "+experiment=quickstart", "--dry-run"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "cluster.launcher" in r.stderr


def test_het_job_two_nodes(slurm, tiny_model_dir, tmp_path):
    run = tmp_path / "het"
    # progress bars on (the default): a batch log gets plain periodic lines, not redraws
    r = agent_r1(
        ["launch", *reduced(tiny_model_dir, run, "cluster=slurm_cpu", "trainer.progress=true")], slurm
    )
    job = submitted_id(r.stdout)
    assert f"tensorboard --logdir {run}/tensorboard" in r.stdout
    states = wait_job(job, slurm)
    out = (run / "logs" / f"slurm-{job}.out").read_text()
    assert set(states) == {"COMPLETED"}, out[-3000:]
    # readable with tail -f: small, no carriage-return redraws, no error lines on a normal end
    raw = (run / "logs" / f"slurm-{job}.out").read_bytes()
    assert len(raw) < 20_000 and b"\r" not in raw, out[-3000:]
    assert not [line for line in out.splitlines() if "error" in line.lower()], out[-3000:]
    assert "[agent-r1] learners exited with 0" in out
    s = check_finished(subprocess.CompletedProcess([], 0, out, ""), run, 2)
    assert s["iterations"] == 2
    check_events(run, 2)
    roles = {p.stem: json.loads(p.read_text()) for p in (run / "control" / "roles").glob("*.json")}
    assert roles["learner_0"]["node"] == "n1" and roles["learner_0"]["address"] == "127.0.1.1"
    assert roles["server_0"]["node"] == "n2" and roles["server_0"]["address"] == "127.0.1.2"
    assert roles["worker_0"]["node"] == "n2"
    assert all(r["env"] == "SLURM_PROCID" for r in roles.values())
    server_url = json.loads((run / "control" / "servers" / "server_0.json").read_text())["url"]
    assert server_url.startswith("http://127.0.1.2:")


def test_job_array_sweep_and_report(slurm, tiny_model_dir, tmp_path):
    spec = tmp_path / "sweep.yaml"
    base = reduced(
        tiny_model_dir, tmp_path / "unused", "trainer.iterations=1", "sft.steps=0", "trainer.plot=false"
    )
    base = [a for a in base if not a.startswith("trainer.run_dir=")]
    spec.write_text(
        json.dumps(
            {
                "name": "t",
                "base": base,
                "grid": {"algorithm": ["grpo", "steppo"], "optim.lr": [1e-4, 1e-3]},
                "max_parallel": 2,
            }
        )
    )
    out_dir = tmp_path / "sweep"
    r = agent_r1(["sweep", str(spec), "cluster=slurm_cpu", "--out", str(out_dir)], slurm)
    job = submitted_id(r.stdout)
    assert "4 tasks" in r.stdout
    states = wait_job(job, slurm, timeout=500)
    assert states and set(states) == {"COMPLETED"}, [
        p.read_text()[-1500:] for p in sorted((out_dir / "logs").glob("*.out"))
    ]
    tasks = json.loads((out_dir / "sweep.json").read_text())["tasks"]
    assert [t["overrides"] for t in tasks] == [
        ["algorithm=grpo", "optim.lr=0.0001"],
        ["algorithm=grpo", "optim.lr=0.001"],
        ["algorithm=steppo", "optim.lr=0.0001"],
        ["algorithm=steppo", "optim.lr=0.001"],
    ]
    for i, t in enumerate(tasks):
        run = out_dir / f"task_{i:03d}"
        s = json.loads((run / "summary.json").read_text())
        assert s["algorithm"] == t["overrides"][0].split("=")[1] and s["iterations"] == 1
        assert list((run / "tensorboard").glob("events.out.tfevents.*"))  # its own TensorBoard run
        cfg = OmegaConf.load(run / "config.yaml")
        assert cfg.optim.lr == float(t["overrides"][1].split("=")[1])
        # a two-node allocation per task: learner on its first node, rollout roles on the second
        roles = {p.stem: json.loads(p.read_text()) for p in (run / "control" / "roles").glob("*.json")}
        assert roles["learner_0"]["node"] != roles["server_0"]["node"], roles
        assert roles["server_0"]["node"] == roles["worker_0"]["node"]
    rep = sh([sys.executable, str(ROOT / "tools" / "sweep_report.py"), str(out_dir)], slurm).stdout
    lines = [x for x in rep.splitlines() if x.startswith("| ") and "task" not in x]
    assert len(lines) == 4 and all("| done |" in x for x in lines), rep


def test_requeue_resumes_without_losing_or_repeating_records(slurm, tiny_model_dir, tmp_path):
    run = tmp_path / "requeue"
    args = reduced(tiny_model_dir, run, "cluster=slurm_cpu", "trainer.iterations=4", "trainer.eval_every=2")
    job = submitted_id(agent_r1(["launch", *args], slurm).stdout)
    deadline = time.time() + 300
    while not (run / "records" / "iter_000001" / "manifest.json").exists():
        assert time.time() < deadline, "iteration 1 never committed"
        time.sleep(0.1)
    sh(["scontrol", "requeue", job], slurm)
    states = wait_job(job, slurm, timeout=400)
    out = (run / "logs" / f"slurm-{job}.out").read_text()
    assert set(states) == {"COMPLETED"}, out[-3000:]
    assert "(restart 0)" in out and "(restart 1)" in out and "DUE TO JOB REQUEUE" in out
    assert "resumed from" in (run / "logs" / "learner_0.log").read_text()
    check_finished(subprocess.CompletedProcess([], 0, out, ""), run, 4)
    assert [e["iteration"] for e in ledger(run)] == [0, 1, 2, 3]
    check_events(run, 4, eval_every=2)


def test_mpi4py_advantages_under_srun_pmix(slurm, tmp_path):
    recs = tmp_path / "records"
    agent_r1(["records", "synth", "--trajectories", "120", "--group-size", "4", "--out", str(recs)], slurm)
    cli = ["records", "advantages", str(recs), "--estimator", "gae", "--gamma", "0.9"]
    agent_r1([*cli, "--out", str(tmp_path / "one")], slurm)
    r = sh(
        [
            "srun",
            "-N2",
            "-n2",
            "--mpi=pmix",
            sys.executable,
            "-m",
            "agent_r1.cli",
            *cli,
            "--out",
            str(tmp_path / "two"),
        ],
        slurm,
        timeout=300,
    )
    assert "r1/2" in r.stdout  # two MPI ranks, one per node

    def load(d):
        t = RecordStore(d).read(0)
        t = t.take(pc.sort_indices(t, [("trajectory_id", "ascending"), ("step_index", "ascending")]))
        return t.column("trajectory_id").to_pylist(), np.array(t.column("advantage").to_pylist())

    ids1, a1 = load(tmp_path / "one")
    ids2, a2 = load(tmp_path / "two")
    assert ids1 == ids2 and len(ids1) > 200
    np.testing.assert_allclose(a1, a2, atol=1e-9)


def test_time_limit_signal_checkpoints_and_continues_in_a_successor_job(slurm, tiny_model_dir, tmp_path):
    """USR1 (what --signal=B:USR1@N sends before the time limit) -> the coordinator checkpoints after
    the current iteration and exits -> the job submits its successor -> which resumes and finishes."""
    run = tmp_path / "usr1"
    args = reduced(
        tiny_model_dir,
        run,
        "cluster=slurm_cpu",
        "trainer.iterations=4",
        "trainer.eval_every=4",
        "trainer.checkpoint_every=4",  # the only mid-run checkpoint is the one the signal asks for
    )
    job = submitted_id(agent_r1(["launch", *args], slurm).stdout)
    deadline = time.time() + 300
    while not (run / "records" / "iter_000000" / "manifest.json").exists():
        assert time.time() < deadline, "iteration 0 never committed"
        time.sleep(0.1)
    sh(["scancel", "--batch", "--signal=USR1", job], slurm)
    assert set(wait_job(job, slurm, timeout=300)) == {"COMPLETED"}
    first = (run / "logs" / f"slurm-{job}.out").read_text()
    successor = (run / "control" / "slurm_job_id").read_text().strip()
    assert successor != job and f"the run continues in job {successor}" in first, first[-3000:]
    assert "USR1: asking the coordinator" in first
    states = wait_job(successor, slurm, timeout=300)
    out = (run / "logs" / f"slurm-{successor}.out").read_text()
    assert set(states) == {"COMPLETED"}, out[-3000:]
    log = (run / "logs" / "learner_0.log").read_text()
    assert "stop requested" in log and "resumed from" in log
    check_finished(subprocess.CompletedProcess([], 0, out, ""), run, 4)
    assert [e["iteration"] for e in ledger(run)] == [0, 1, 2, 3]


def test_launch_colocated_dry_run(tmp_path):
    r = agent_r1(
        [
            "launch",
            "+experiment=quickstart",
            "cluster=slurm_cpu",
            "cluster.colocated=true",
            "parallel=cpu_dp2",
            "rollout.workers=2",
            f"trainer.run_dir={tmp_path / 'colo'}",
            "--dry-run",
        ],
        dict(os.environ),
    )
    assert "#SBATCH hetjob" not in r.stdout and "--het-group" not in r.stdout
    assert "#SBATCH --nodes=1" in r.stdout and "#SBATCH --ntasks-per-node=2" in r.stdout
    sruns = [x for x in r.stdout.splitlines() if x.startswith("srun ")]
    assert [("role server" in x, "role worker" in x, "role learner" in x) for x in sruns] == [
        (True, False, False),
        (False, True, False),
        (False, False, True),
    ]
    assert "--ntasks=2" in sruns[1] and "--ntasks=2" in sruns[2] and all("--overlap" in x for x in sruns)


def test_server_killed_under_slurm_is_restarted_in_place_behind_the_router(slurm, tiny_model_dir, tmp_path):
    """kill -9 of the only rollout server of a 2-node job: its supervisor restarts it in the same
    step, it registers with the run's sglang-router again and gets the current weights; the run
    finishes with every record of every iteration, each trained once."""
    run = tmp_path / "slurmkill"
    args = reduced(
        tiny_model_dir, run, "cluster=slurm_cpu", "rollout.router=true", "episode.max_action_tokens=48"
    )
    job = submitted_id(agent_r1(["launch", *args], slurm).stdout)
    prog = run / "control" / "tasks" / "train_000000.w0.progress"
    deadline = time.time() + 300
    while not prog.exists():
        assert time.time() < deadline, "the first rollout never started"
        time.sleep(0.05)
    victim = json.loads((run / "control" / "roles" / "server_0.json").read_text())["pid"]
    os.kill(victim, 9)  # n2 is this host: its processes are ours to kill
    states = wait_job(job, slurm, timeout=400)
    out = (run / "logs" / f"slurm-{job}.out").read_text()
    assert set(states) == {"COMPLETED"}, out[-3000:]
    assert "server_0 exited with -9; restarting it" in out
    assert json.loads((run / "control" / "roles" / "server_0.json").read_text())["pid"] != victim
    server_log = (run / "logs" / "server_0.log").read_text()
    assert server_log.count("registered with the router") == 2
    check_finished(subprocess.CompletedProcess([], 0, out, ""), run, 2)
    for it in range(2):
        assert (
            json.loads((run / "records" / f"iter_{it:06d}" / "manifest.json").read_text())["num_trajectories"]
            == 16
        )
    assert [e["iteration"] for e in ledger(run)] == [0, 1]


def test_learner_ranks_span_two_nodes_and_resume(slurm, tiny_model_dir, tmp_path):
    """DP2 with one learner rank on n1 and one on n2 (one allocation, rollout roles beside them):
    the gloo group forms across the nodes' addresses, the run completes, and a second launch
    with more iterations resumes from its checkpoint. The run is PSPO as the seed defines it
    (critic, reference + k3 KL, tight clip) with reward scaling and two rollout workers: the
    scaler's running moments count every step of both ranks and are checkpointed and resumed."""
    run = tmp_path / "twonodes"
    base = [
        "cluster=slurm_cpu",
        "cluster.colocated=true",
        "cluster.learner_nodes=2",
        "parallel=cpu_dp2",
        "algorithm=pspo",
        "algorithm.reward_scaling=true",
        "rollout.workers=2",
    ]
    job = submitted_id(agent_r1(["launch", *reduced(tiny_model_dir, run, *base)], slurm).stdout)
    states = wait_job(job, slurm)
    out = (run / "logs" / f"slurm-{job}.out").read_text()
    assert set(states) == {"COMPLETED"}, out[-3000:]
    roles = {p.stem: json.loads(p.read_text()) for p in (run / "control" / "roles").glob("*.json")}
    assert {roles["learner_0"]["node"], roles["learner_1"]["node"]} == {"n1", "n2"}
    assert {roles["learner_0"]["address"], roles["learner_1"]["address"]} == {"127.0.1.1", "127.0.1.2"}
    check_finished(subprocess.CompletedProcess([], 0, out, ""), run, 2)
    scalars = check_events(run, 2)
    assert len(manifest(run, 0)["shards"]) == 2  # one shard per worker
    assert "loss/kl" in scalars and "critic/value_loss" in scalars and "reward/scaling_std" in scalars

    def moments(it):
        state = json.loads((run / "checkpoints" / f"iter_{it:06d}" / "agent_r1_state.json").read_text())
        return state["trainer"]["reward_scaling"]

    first = moments(1)
    assert first["count"] == sum(manifest(run, it)["rows"] for it in range(2))  # every step, both ranks
    job2 = submitted_id(
        agent_r1(["launch", *reduced(tiny_model_dir, run, *base, "trainer.iterations=3")], slurm).stdout
    )
    states = wait_job(job2, slurm)
    out2 = (run / "logs" / f"slurm-{job2}.out").read_text()
    assert set(states) == {"COMPLETED"}, out2[-3000:]
    assert "resumed from" in (run / "logs" / "learner_0.log").read_text()
    check_finished(subprocess.CompletedProcess([], 0, out2, ""), run, 3)
    assert [e["iteration"] for e in ledger(run)] == [0, 1, 2]
    assert moments(2)["count"] == first["count"] + manifest(run, 2)["rows"]  # resumed, not restarted


def test_gpu_sweep_renders_one_multi_node_allocation_per_task(tmp_path):
    """Slurm has no arrays of het jobs: every array task of a GPU sweep is one block of learner +
    rollout nodes whose roles are placed with srun --relative, with the GPU preset's layout."""
    spec = tmp_path / "gpu_sweep.yaml"
    spec.write_text(
        json.dumps(
            {
                "name": "g",
                "base": ["+experiment=qwen3_4b_gsm8k_tool_steppo_4n8g"],
                "grid": {"optim.lr": [1e-6, 2e-6]},
            }
        )
    )
    r = agent_r1(["sweep", str(spec), "--out", str(tmp_path / "sw"), "--dry-run"], dict(os.environ))
    script, _, job = r.stdout.partition("# ---- task_000/job.sh")
    assert "#SBATCH --array=0-1%2" in script and "#SBATCH --nodes=6" in script  # 4 learner + 2 rollout
    assert (
        "#SBATCH --ntasks-per-node=9" in script and "#SBATCH --gpus-per-node=8" in script
    )  # 16 servers + 2 workers on 2 nodes
    assert 'task_$(printf %03d "$SLURM_ARRAY_TASK_ID")/job.sh' in script and "sweep-task" not in script
    assert "#SBATCH --" not in job and "--het-group" not in job
    learner = next(line for line in job.splitlines() if " role learner " in line)
    assert "--relative=0" in learner and "--ntasks=32" in learner and "--nodes=4" in learner
    server = next(line for line in job.splitlines() if " role server " in line)
    assert "--relative=4" in server and "--gpus-per-task=1" in server and "--supervise" in server
    assert f"--run-dir {tmp_path / 'sw' / 'task_000'}" in job


def test_the_command_line_replaces_the_sweeps_experiment(tmp_path):
    """``agent-r1 sweep S.yaml +experiment=X`` on a sweep whose base names another experiment runs X
    (Hydra alone refuses two values for one key), and any other key given twice takes the command
    line's value."""
    from agent_r1.launch.slurm import merge_overrides, sweep

    assert merge_overrides(["+experiment=quickstart", "optim.lr=1e-5"], ["+experiment=webshop_steppo", "seed=3"]) == [
        "+experiment=webshop_steppo", "optim.lr=1e-5", "seed=3"]  # fmt: skip
    assert merge_overrides(["+experiment=quickstart"], ["experiment=webshop_steppo"]) == [
        "+experiment=webshop_steppo"
    ]
    spec = tmp_path / "sweep.yaml"
    spec.write_text(json.dumps({"name": "s", "base": ["+experiment=quickstart", "optim.lr=1e-5"],
                                "grid": {"rollout.group_size": [2, 4]}}))  # fmt: skip
    out = sweep(
        spec, ["+experiment=smollm2_gsm8k_tool", "optim.lr=3e-6"], dry_run=True, out_dir=str(tmp_path / "sw")
    )
    args = [t["args"] for t in out["tasks"]]
    assert all("+experiment=smollm2_gsm8k_tool" in a and "+experiment=quickstart" not in a for a in args)
    assert all("optim.lr=3e-6" in a and "optim.lr=1e-5" not in a for a in args)
