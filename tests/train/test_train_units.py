"""Trainer pieces without processes: the data cursor, rollout tasks, demonstrations, the plot."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from agent_r1.agent.episode import EpisodeSettings
from agent_r1.train.coordinator import checkpoint_candidates, prompt_indices, remove_partial_checkpoints
from agent_r1.train.run_dir import RunDir
from agent_r1.train.tasks import RolloutTask, acknowledge, forget_tasks_after, pending_tasks, write_task


def test_data_cursor_is_a_deterministic_permutation_per_epoch():
    n, per = 10, 4
    its = [prompt_indices(n, per, seed=3, iteration=i) for i in range(5)]  # 20 prompts = 2 epochs
    flat = [x for it in its for x in it]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    assert flat[:10] != flat[10:]  # a new order each epoch
    assert its == [prompt_indices(n, per, seed=3, iteration=i) for i in range(5)]  # resumable
    assert prompt_indices(n, per, seed=4, iteration=0) != its[0]
    assert prompt_indices(3, 7, seed=0, iteration=0)[:3] == prompt_indices(3, 3, seed=0, iteration=0)


def _task(name="train_000001", iteration=1, workers=2, rows=(5, 6, 7)):
    return RolloutTask(name, "train", iteration, "train", list(rows), 2, EpisodeSettings(), 0, 3, workers)


def test_task_shares_cover_rows_once():
    t = _task(rows=range(7), workers=3)
    got = sorted(r for k in range(3) for _, r in t.share(k))
    assert got == list(range(7))


def test_pending_acknowledge_forget(tmp_path: Path):
    rd = RunDir.at(tmp_path).create()
    write_task(rd, _task("train_000001", 1))
    write_task(rd, _task("eval_000002", 2))
    write_task(rd, _task("train_000003", 3))
    assert [t.name for t in pending_tasks(rd, 0)] == ["train_000001", "eval_000002", "train_000003"]
    acknowledge(rd, pending_tasks(rd, 0)[0], 0, {"episodes": 3})
    assert [t.name for t in pending_tasks(rd, 0)] == ["eval_000002", "train_000003"]
    assert len(pending_tasks(rd, 1)) == 3
    forget_tasks_after(rd, 1)
    names = sorted(p.name for p in rd.tasks.iterdir())
    assert names == ["train_000001.json", "train_000001.w0.done"]


def test_a_task_carries_its_episode_settings_whole(tmp_path: Path):
    rd = RunDir.at(tmp_path).create()
    task = _task()
    task.episode = EpisodeSettings(
        max_steps=7, max_obs_tokens=300, max_action_tokens=20, temperature=0.5, top_p=0.9
    )
    write_task(rd, task)
    (got,) = pending_tasks(rd, 0)
    assert got.episode == task.episode and got == task
    flow = got.episode.flow(seed=got.seed)
    assert (flow.max_steps, flow.max_obs_tokens, flow.max_action_tokens) == (7, 300, 20)
    assert (flow.sampling.temperature, flow.sampling.top_p, flow.sampling.max_new_tokens) == (0.5, 0.9, 20)


def test_checkpoint_candidates_newest_complete_first_and_partial_ones_removed(tmp_path: Path):
    rd = RunDir.at(tmp_path).create()
    assert checkpoint_candidates(rd, "auto") == []
    for i in (1, 3):
        (rd.checkpoints / f"iter_{i:06d}").mkdir()
        (rd.checkpoints / f"iter_{i:06d}" / "agent_r1_state.json").write_text("{}")
    (rd.checkpoints / "iter_000005.tmp").mkdir()  # a save that died
    (rd.checkpoints / "iter_000004").mkdir()  # no state file: incomplete
    (rd.checkpoints / "iter_000006.corrupt").mkdir()  # refused by an earlier resume
    assert [p.name for p in checkpoint_candidates(rd, "auto")] == ["iter_000003", "iter_000001"]
    assert checkpoint_candidates(rd, "never") == []
    assert checkpoint_candidates(rd, "/x/iter_000002") == [Path("/x/iter_000002")]
    remove_partial_checkpoints(rd)
    assert not (rd.checkpoints / "iter_000005.tmp").exists() and (rd.checkpoints / "iter_000003").exists()


def test_noisy_demonstrator_replayed_through_the_agent_flow(codec):
    from agent_r1.agent.flow import FlowConfig
    from agent_r1.train.sft import demonstration_records
    from recipes import load_all, load_recipe

    load_all()
    recipe = load_recipe("arithmetic_tool")
    rows = recipe.build_rows("train", 40, seed=1, difficulty=1)
    trajs = demonstration_records(recipe, rows, codec, FlowConfig(max_steps=3), seed=0, tool_rate=0.5)
    tool = [t for t in trajs if t.num_tool_calls == 1]
    guess = [t for t in trajs if t.num_tool_calls == 0]
    assert 8 <= len(tool) <= 32 and len(tool) + len(guess) == 40
    assert all(t.metrics["success"] == 1.0 and len(t.steps) == 2 for t in tool)  # the tool path is right
    assert all(t.metrics["success"] == 0.0 and len(t.steps) == 1 for t in guess)  # guessing is wrong
    # the second observation is what the env built: the tool's answer follows the first action
    s0, s1 = tool[0].steps
    assert s1.obs_token_ids[: len(s0.obs_token_ids) + len(s0.action_token_ids)] == (
        s0.obs_token_ids + s0.action_token_ids
    )
    by_id = {f"sft-p{i}-s0": r for i, r in enumerate(rows)}
    for t in tool:
        answer = by_id[t.trajectory_id].reward_model["ground_truth"]
        assert f"\\boxed{{{answer}}}" in codec.decode(t.steps[-1].action_token_ids)


def test_stats_from_record_columns_equal_stats_from_trajectories(codec):
    """The coordinator's column-only statistics of committed records agree with the trajectories'
    own (success from the flow's scoring vs from the terminal step's info)."""
    from agent_r1.agent.flow import FlowConfig
    from agent_r1.records.schema import records_to_table
    from agent_r1.train.metrics import STATS_COLUMNS, episode_stats, table_stats
    from agent_r1.train.sft import demonstration_records
    from recipes import load_all, load_recipe

    load_all()
    recipe = load_recipe("arithmetic_tool")
    rows = recipe.build_rows("train", 30, seed=2, difficulty=1)
    trajs = demonstration_records(recipe, rows, codec, FlowConfig(max_steps=2), seed=1, tool_rate=0.6)
    cut = demonstration_records(recipe, rows[:10], codec, FlowConfig(max_steps=1), seed=1, tool_rate=1.0)
    for t in cut:  # out of steps after the tool call: truncated, unanswered
        for s in t.steps:
            s.trajectory_id = t.trajectory_id = f"cut-{t.trajectory_id}"
    trajs += cut
    table = records_to_table([s for t in trajs for s in t.steps]).select(STATS_COLUMNS)
    want = episode_stats(trajs)
    assert 0 < want["success"] < want["episodes"] == 40  # right (tool), wrong (guess), truncated
    assert want["truncated"] > 0 and want["tool_calls"] > 0
    assert table_stats(table) == pytest.approx(want)


def test_plot_and_read_scalars(tmp_path: Path):
    from agent_r1.train.metrics import Reporter
    from agent_r1.train.plot import plot_run, read_scalars

    rep = Reporter(str(tmp_path / "tb"))
    for step in range(4):
        rep.scalars({"eval/success": 0.1 * step, "rollout/success": 0.2 * step, "bad": float("nan")}, step)
    rep.close()
    s = read_scalars(tmp_path / "tb")
    assert s["eval/success"] == [(i, pytest.approx(0.1 * i)) for i in range(4)]
    assert "bad" not in s  # non-finite values are not written
    png = plot_run(tmp_path / "tb", tmp_path / "curve.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_worker_metrics_and_console_line():
    from agent_r1.train.metrics import console_line, rollout_scalars

    pooled = {
        "episodes": 4.0,
        "success": 1.0,
        "reward": 2.0,
        "steps": 8.0,
        "tool_calls": 4.0,
        "action_tokens": 80.0,
    }
    m = rollout_scalars(pooled)
    assert m["rollout/success"] == 0.25 and m["rollout/steps_per_trajectory"] == 2.0
    assert m["rollout/response_tokens_per_step"] == 10.0
    line = console_line(2, 10, {**m, "loss/pg": -0.5, "time/generate": 1.25})
    assert line.startswith("iter 3/10") and "success 0.250" in line and "gen 1.2s" in line


def test_demonstrator_rejects_extra_turns(codec):
    from agent_r1.agent.demonstrations import Demonstrator
    from agent_r1.rollout.protocol import SamplingParams

    d = Demonstrator(codec, {"t": ["hello"]})
    gen = d.session("t")
    out = asyncio.run(gen([1, 2], SamplingParams(max_new_tokens=50)))
    assert out.token_ids[-1] == codec.im_end_id and codec.decode_action(out.token_ids) == "hello"
    with pytest.raises(RuntimeError, match="no turn left"):
        asyncio.run(gen([1, 2], SamplingParams(max_new_tokens=50)))
