"""``trainer.deterministic``: two runs of the same config and seed give the same bits — every
record (tokens, logprobs, rewards), the weights after every iteration and the summary — one of them
beside a busy process that takes a core (other thread timings, other batches on the server); and
the learner's logprobs of the sampled actions are the engine's, bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from agent_r1.records.reader import RecordStore
from tests.helpers.train_checks import check_finished, read_scalars, reduced, train

pytestmark = pytest.mark.slow

KEYS = ["group_id", "trajectory_id", "step_index"]
VARYING = ("wall_seconds", "launch_seconds", "run_dir", "tensorboard")  # clock readings, each run's own paths


def run(model: Path, run_dir: Path, busy: bool) -> dict:
    neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        r = train(reduced(model, run_dir, "trainer.deterministic=true", "sft.steps=20"), timeout=600)
    finally:
        if neighbour is not None:
            neighbour.kill()
    return check_finished(r, run_dir, 2)


def records(run_dir: Path, sub: str = "records") -> list[pa.Table]:
    store = RecordStore(run_dir / sub)
    return [store.read(i).sort_by([(k, "ascending") for k in KEYS]) for i in range(2)]


def checkpoint_files(run_dir: Path) -> dict[str, bytes]:
    out = {}
    for f in sorted((run_dir / "checkpoints").rglob("*")):
        if f.is_file() and f.suffix in (".distcp", ".pt"):
            out[str(f.relative_to(run_dir))] = f.read_bytes()
    return out


def test_two_deterministic_runs_give_the_same_records_weights_and_summary(tiny_model_dir, tmp_path):
    a = run(tiny_model_dir, tmp_path / "a", busy=False)
    b = run(tiny_model_dir, tmp_path / "b", busy=True)
    ra, rb = records(tmp_path / "a"), records(tmp_path / "b")
    for i, (x, y) in enumerate(zip(ra, rb, strict=True)):
        assert x.num_rows > 0
        for col in x.column_names:
            assert x.column(col).equals(y.column(col)), f"iteration {i}: {col} differs"
    # the shards themselves, byte for byte (their checksums in the manifests)
    for i in range(2):
        ma, mb = (
            json.loads((r / "records" / f"iter_{i:06d}" / "manifest.json").read_text())
            for r in (tmp_path / "a", tmp_path / "b")
        )
        assert {k: v["checksum"] for k, v in ma["shards"].items()} == {
            k: v["checksum"] for k, v in mb["shards"].items()
        }
    fa, fb = checkpoint_files(tmp_path / "a"), checkpoint_files(tmp_path / "b")
    assert fa and fa.keys() == fb.keys()
    assert [k for k in fa if fa[k] != fb[k]] == []
    assert {k: v for k, v in a.items() if k not in VARYING} == {
        k: v for k, v in b.items() if k not in VARYING
    }
    # true on-policy: the learner's logprobs of every sampled action are the engine's bits
    scalars = read_scalars(tmp_path / "a" / "tensorboard")
    assert [v for _, v in scalars["mismatch/bitwise_equal_fraction"]] == [1.0, 1.0]
    assert [v for _, v in scalars["mismatch/max_abs_logprob_diff"]] == [0.0, 0.0]
