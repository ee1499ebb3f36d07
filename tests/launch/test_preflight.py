"""Pre-flight: impossible layouts, hardware the machine lacks, a mistyped model path and bad data
rows are refused when the run starts, before any process, each naming its key or row."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent_r1.agent.flow import FlowConfig
from agent_r1.data.rows import DataRow
from agent_r1.launch.preflight import _check_rows, model_problems
from agent_r1.train.config import load_config


def _train(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.time()
    r = subprocess.run(
        [sys.executable, "-m", "agent_r1.cli", "train", "+experiment=quickstart", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return r, time.time() - t0


@pytest.mark.parametrize(
    "overrides,msg",
    [
        (["parallel.pp=2", "parallel.learner_ranks=2", "model.max_len=2048"], None),  # possible: no problem
        (["parallel.pp=4", "parallel.learner_ranks=4"], "parallel.pp=4: the model's 2 layers"),
        (
            ["parallel.pp=2", "parallel.vpp=2", "parallel.learner_ranks=2"],
            "parallel.pp=2 x parallel.vpp=2: the model's 2 layers do not split evenly into 4 pipeline stages",
        ),
        (
            ["parallel.tp=3", "parallel.learner_ranks=3"],
            "parallel.tp=3 does not divide the model's 4 attention heads",
        ),
        (
            ["parallel.tp=4", "parallel.learner_ranks=4"],
            "parallel.tp=4 does not divide the model's 2 key-value heads",
        ),
        (
            ["parallel.ep=2", "parallel.learner_ranks=2"],
            "parallel.ep=2: the model is dense (no experts to spread); use parallel.ep=1",
        ),
        (["model.precision=fp8"], "model.precision=fp8 needs NVIDIA GPUs"),
        (
            ["model.max_len=16"],
            "episode.max_obs_tokens=512 + episode.max_action_tokens=48 = 560 must fit model.max_len=16",
        ),
        (["episode.max_action_tokens=100000"], "= 100512 must fit model.max_len=2048"),
    ],
)
def test_model_and_layout_problems(tiny_model_dir, overrides, msg):
    cfg = load_config(
        ["+experiment=quickstart", f"model.path={tiny_model_dir}", "model.build=null", *overrides]
    )
    problems = model_problems(cfg)
    if msg is None:
        assert problems == []
    else:
        assert any(msg in p for p in problems), problems


def test_impossible_run_is_refused_before_any_process(tiny_model_dir, tmp_path):
    run = tmp_path / "bad"
    r, seconds = _train(
        f"model.path={tiny_model_dir}",
        "model.build=null",
        f"trainer.run_dir={run}",
        "parallel.pp=4",
        "parallel.learner_ranks=4",
        "model.max_len=16",
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert "the run cannot start" in r.stderr
    assert "parallel.pp=4" in r.stderr and "model.max_len=16" in r.stderr  # all problems at once
    assert seconds < 60
    assert not list((run / "control" / "roles").glob("*.json"))  # no role was started


def test_mistyped_model_path_is_not_built_silently(tmp_path):
    typo = tmp_path / "tiny-qwen3-typo"
    r, _ = _train(f"model.path={typo}", f"trainer.run_dir={tmp_path / 'run'}")
    assert r.returncode == 2
    assert f"model.path: {typo} does not exist" in r.stderr and "model.build.at" in r.stderr
    assert not typo.exists()


def _row(**kw) -> DataRow:
    base = dict(
        prompt=[{"role": "user", "content": "What is 2 + 3?"}],
        agent_name="tool_agent",
        reward_model={"style": "math_number", "ground_truth": "5"},
        data_source="hand",
        env_kwargs={"tools": ["calculator"]},
    )
    return DataRow(**{**base, **kw})


def test_bad_data_rows_are_named(codec):
    rows = [
        _row(),
        _row(env_kwargs={"tools": ["calculator"], "max_stepz": 3}),
        _row(env_kwargs={"tools": ["calculator"], "max_steps": 0}),
        _row(env_kwargs={"tools": ["abacus"]}),
        _row(reward_model={"style": "math_numbr", "ground_truth": "5"}),
        _row(reward_model={"style": "math_number", "ground_truth": "five"}),
        _row(reward_model={"style": "math_number", "ground_truth": "5", "colour": "red"}),
        _row(agent_name="tool_agnt"),
    ]
    flow = FlowConfig(max_steps=3, max_obs_tokens=512, max_action_tokens=32)
    problems = asyncio.run(_check_rows(rows, "train", codec, flow))
    text = "\n".join(problems)
    assert not any(p.startswith("train row 0:") for p in problems)
    for i, what in [
        (1, "max_stepz"),
        (2, "max_steps must be >= 1"),
        (3, "abacus"),
        (4, "'math_numbr' is not a registered reward"),
        (5, "'five' is not a number"),
        (6, "colour"),
        (7, "'tool_agnt' is not a registered agent"),
    ]:
        assert any(p.startswith(f"train row {i}:") and what in p for p in problems), (i, text)


def test_environment_resets_stop_at_their_time_budget_and_the_other_checks_go_on(codec, caplog):
    # resets cost real time (an ALFWorld game loads in ~0.3 s): past the budget, rows are still
    # checked for their agent and reward, and the log says how many first observations were seen
    rows = [
        _row(env_kwargs={"tools": ["abacus"]}),
        _row(reward_model={"style": "math_numbr", "ground_truth": "5"}),
        _row(agent_name="tool_agnt"),
    ]
    flow = FlowConfig(max_steps=3, max_obs_tokens=8, max_action_tokens=4)
    with caplog.at_level("INFO", logger="agent_r1.preflight"):
        problems = asyncio.run(_check_rows(rows, "train", codec, flow, reset_budget_s=-1.0))
    assert len(problems) == 2, problems  # no reset: neither the tool nor the prompt length is judged
    assert problems[0].startswith("train row 1:") and "'math_numbr' is not a registered reward" in problems[0]
    assert problems[1].startswith("train row 2:") and "'tool_agnt' is not a registered agent" in problems[1]
    assert "first observations of 0 of 3 rows checked" in caplog.text
    with_resets = asyncio.run(_check_rows(rows, "train", codec, flow))
    assert any(p.startswith("train row 0:") and "abacus" in p for p in with_resets), with_resets


def test_prompts_longer_than_the_budget_are_refused(codec):
    flow = FlowConfig(max_steps=3, max_obs_tokens=8, max_action_tokens=4)
    problems = asyncio.run(_check_rows([_row(), _row()], "test", codec, flow))
    assert any("every first observation is longer than episode.max_obs_tokens=8" in p for p in problems)


@pytest.mark.parametrize(
    "overrides,msg",
    [
        (["retrieval.index=null"], "recipe hotpotqa searches: set retrieval.index=DIR (built when missing)"),
        (
            ["retrieval.index=/nonexistent/idx", "retrieval.build=false"],
            "retrieval.index=/nonexistent/idx does not exist and retrieval.build=false; build it with: "
            "agent-r1 index build --corpus PASSAGES.jsonl --out /nonexistent/idx",
        ),
    ],
)
def test_missing_index_is_refused_naming_the_command(overrides, msg):
    from agent_r1.launch.preflight import retrieval_problems

    assert retrieval_problems(load_config(["+experiment=hotpotqa_steppo", *overrides])) == [msg]
    assert retrieval_problems(load_config(["+experiment=hotpotqa_steppo"])) == []  # built when missing
    assert retrieval_problems(load_config(["+experiment=quickstart"])) == []  # no search, no index


def test_expert_parallel_against_an_moe_model(tmp_path):
    """The experts of the model the run reads (its config.json) must split evenly over EP."""
    cfg_dir = tmp_path / "moe"
    cfg_dir.mkdir()
    shipped = Path(__file__).resolve().parents[2] / "configs/model/hf/Qwen3-30B-A3B/config.json"
    (cfg_dir / "config.json").write_text(shipped.read_text())
    base = ["+experiment=quickstart", f"model.path={cfg_dir}", "model.build=null", "model.max_len=4096"]
    ok = model_problems(load_config([*base, "parallel.ep=8", "parallel.learner_ranks=8"]))
    assert not [p for p in ok if "parallel.ep" in p], ok
    bad = model_problems(load_config([*base, "parallel.ep=3", "parallel.learner_ranks=3"]))
    assert "parallel.ep=3 does not divide the model's 128 experts" in bad, bad
    # tensor parallelism with experts: sequence parallel, and the experts spread (EP > 1)
    tp = [*base, "parallel.tp=2", "parallel.learner_ranks=2"]
    bad = model_problems(load_config(tp))
    assert [
        p for p in bad if p.startswith("parallel.tp=2 with a mixture-of-experts model needs parallel.sp=true")
    ]
    assert [
        p for p in bad if p.startswith("parallel.tp=2 with a mixture-of-experts model needs parallel.ep > 1")
    ]
    ok = model_problems(load_config([*tp, "parallel.sp=true", "parallel.ep=2"]))
    assert not [p for p in ok if "parallel." in p], ok
