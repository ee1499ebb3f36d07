"""``agent-r1 records audit RUN``: a finished run passes; each way of losing or repeating training,
written into a copy of it by hand, is found and named."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def _audit(run: Path) -> tuple[int, dict]:
    r = subprocess.run(
        [sys.executable, "-m", "agent_r1.cli", "records", "audit", str(run)], capture_output=True, text=True
    )
    return r.returncode, json.loads(r.stdout[: r.stdout.rindex("}") + 1])


def test_a_finished_run_trained_every_step_once(finished_run):
    rc, out = _audit(finished_run)
    assert rc == 0 and out["ok"], out
    assert (out["iterations"], out["lost_steps"], out["double_trained"]) == (2, 0, 0)
    assert out["staleness_bound"] == 0 and out["checkpoint"].endswith("iter_000001")


def test_a_repeated_update_is_double_training(copy_run):
    run = copy_run()
    lines = (run / "ledger.jsonl").read_text().splitlines()
    (run / "ledger.jsonl").write_text("\n".join([lines[0], lines[0], lines[1]]) + "\n")
    rc, out = _audit(run)
    assert rc == 1 and out["double_trained"] > 0
    assert any("iteration 0 is in the ledger twice" in p for p in out["problems"]), out["problems"]


def test_a_skipped_iteration_is_lost(copy_run):
    run = copy_run()
    lines = (run / "ledger.jsonl").read_text().splitlines()
    second = json.loads(lines[1])
    (run / "ledger.jsonl").write_text(lines[1] + "\n")  # only iteration 1's update
    rc, out = _audit(run)
    assert rc == 1 and out["lost_steps"] > 0
    assert "iteration 0 is missing from the ledger" in out["problems"]
    # the checkpoint took two updates' optimizer steps; the ledger accounts for one
    assert any("optimizer steps" in p for p in out["problems"]), out["problems"]
    assert second["iteration"] == 1


def test_records_changed_after_their_update_are_named(copy_run):
    run = copy_run()
    shard = next((run / "records" / "iter_000001").glob("shard_*.arrow"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    rc, out = _audit(run)
    assert rc == 1
    assert f"iteration 1: {shard.name} no longer matches the checksum its update saw" in out["problems"]


def test_a_checkpoint_set_aside_as_corrupt_is_not_the_newest(copy_run):
    """A checkpoint that failed its checksums is renamed ``iter_N.corrupt`` and kept: neither it nor an
    interrupted ``.tmp`` save counts as the run's newest."""
    import shutil

    run = copy_run()
    for name in ("iter_000009.corrupt", "iter_000010.tmp"):
        d = shutil.copytree(run / "checkpoints" / "iter_000001", run / "checkpoints" / name)
        state = json.loads((d / "agent_r1_state.json").read_text())
        state["trainer"]["iteration"] = int(name[5:11])
        (d / "agent_r1_state.json").write_text(json.dumps(state))
    rc, out = _audit(run)
    assert rc == 0 and out["checkpoint"].endswith("iter_000001"), out
