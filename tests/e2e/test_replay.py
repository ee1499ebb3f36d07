"""``agent-r1 records replay``: a run's iteration re-trained from its shards and ledger gives the
weights of its checkpoint, bitwise; records that are not what the update consumed are named."""

from __future__ import annotations

import json
import subprocess
import sys

from agent_r1.records.shard import committed_shards


def replay(run, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "agent_r1.cli", "records", "replay", str(run), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_replaying_an_iteration_gives_the_checkpoints_weights_bitwise(finished_run):
    r = replay(finished_run, "--until", "1")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    out = json.loads(r.stdout[r.stdout.index("{\n") : r.stdout.rindex("}") + 1])  # after the log lines
    assert out["iterations"] == [1] and out["tensors"] > 0 and not out["missing"]
    assert out["bitwise_equal"] == out["tensors"] and out["max_abs_diff"] == 0.0
    assert "tensors bitwise equal" in r.stdout


def test_a_shard_the_update_did_not_consume_is_refused(copy_run):
    run = copy_run()
    shard = next(iter(committed_shards(run / "records", 1)))
    manifest = run / "records" / "iter_000001" / "manifest.json"
    m = json.loads(manifest.read_text())
    m["shards"][shard.name]["checksum"] = "0" * 16  # the records are no longer the trained ones
    manifest.write_text(json.dumps(m))
    r = replay(run, "--until", "1")
    assert r.returncode != 0 and "not the ones the ledger says its update consumed" in r.stderr, r.stderr[
        -2000:
    ]


def test_no_checkpoint_to_compare_with_is_named(finished_run):
    r = replay(finished_run, "--until", "7")
    assert r.returncode != 0 and "no checkpoint after iteration 7" in r.stderr, r.stderr[-2000:]
