import json
import subprocess
import sys

import numpy as np
import pyarrow.compute as pc

from agent_r1.records.ragged import ragged_arange
from agent_r1.records.reader import RecordStore
from agent_r1.records.schema import records_from_table
from agent_r1.records.synth import synth_table


def cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "agent_r1.cli", "records", *args], check=True, capture_output=True, text=True
    ).stdout


def test_synth_is_realistic():
    assert ragged_arange(np.array([2, 0, 3])).tolist() == [0, 1, 0, 1, 2]
    t = synth_table(50, group_size=5, max_steps=4, seed=4)
    recs = records_from_table(t)
    by_traj = {}
    for r in recs:
        by_traj.setdefault(r.trajectory_id, []).append(r)
    assert len(by_traj) == 50
    prompts = {}
    for steps in by_traj.values():
        assert [s.step_index for s in steps] == list(range(len(steps)))
        assert steps[-1].done and not any(s.done for s in steps[:-1])
        assert all(len(s.process_reward) == 0 for s in steps[-1:])
        for p, c in zip(steps, steps[1:], strict=False):  # append mode
            assert c.prefix_len == len(p.obs_token_ids) + len(p.action_token_ids)
            assert c.obs_token_ids[: c.prefix_len] == p.obs_token_ids + p.action_token_ids
        first = steps[0]
        prompts.setdefault(first.group_id, set()).add(tuple(first.obs_token_ids))
    assert all(len(v) == 1 for v in prompts.values())  # a group shares its prompt
    assert 0 < sum(s.reward for s in recs if s.done) < 50
    assert synth_table(50, 5, 4, seed=4).equals(t)


def test_synth_stats_show(tmp_path):
    d = tmp_path / "records"
    cli(
        "synth",
        "--trajectories",
        "40",
        "--group-size",
        "4",
        "--writers",
        "3",
        "--iteration",
        "2",
        "--out",
        str(d),
    )
    store = RecordStore(d)
    assert store.iterations() == [2] and len(store.shards(2)) == 3
    groups = [set(store.read_shard(2, m).column("group_id").to_pylist()) for m in store.shards(2)]
    assert groups[0] & groups[1]  # groups span shards
    stats = json.loads(cli("stats", str(d)))["iter_000002"]
    assert stats["trajectories"] == 40 and stats["groups"] == 10 and 0 < stats["prefix_merge_ratio"] < 1
    t = store.read(2)
    tid = t.column("trajectory_id")[0].as_py()
    out = cli("show", str(d), "--trajectory", tid)
    n = int(pc.sum(pc.equal(t.column("trajectory_id"), tid)).as_py())
    assert out.startswith(f"trajectory {tid}") and out.count("--- step") == n
    adv_dir = tmp_path / "adv"
    cli("advantages", str(d), "--estimator", "gae", "--gamma", "0.9", "--lam", "0.95", "--out", str(adv_dir))
    shown = cli("show", str(adv_dir), "--trajectory", tid)
    assert "advantage" in shown and "return" in shown
    a = RecordStore(adv_dir).read(2)
    assert a.num_rows == t.num_rows and "advantage" in a.column_names and "return" in a.column_names
