"""The reasoning_gym recipe: rows of any reasoning-gym generator with its config passed through,
scored by the generator's own ``score_answer`` (compared here with reasoning-gym called directly),
disjoint seeded splits, the calculator mode as a multi-step episode, rows written by ``agent-r1
data`` in the public layout and read back scoring the same."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from scripted import play

from agent_r1.agent.tool_calls import format_tool_call
from agent_r1.data.rows import load_rows
from agent_r1.rewards import compute_reward
from recipes import load_recipe

rg = pytest.importorskip("reasoning_gym")  # installed by the project (pyproject); named if missing
SMALL = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}


@pytest.fixture(scope="module")
def data():
    return load_recipe("reasoning_gym").data


def truth(row) -> dict:
    return json.loads(row.reward_model["ground_truth"])


def test_rows_are_the_generators_items_with_its_config(data):
    rows = data.build_rows("train", 20, seed=3, task="basic_arithmetic", **SMALL)
    ds = rg.create_dataset("basic_arithmetic", size=20, seed=3 * 7919, **SMALL)  # the train split's seed
    for i, row in enumerate(rows):
        assert row.prompt[-1] == {"role": "user", "content": ds[i]["question"]}
        assert row.prompt[0]["content"] == rg.utils.SYSTEM_PROMPTS["default"]
        assert truth(row) == {"task": "basic_arithmetic", "item": json.loads(json.dumps(ds[i]))}
        assert truth(row)["item"]["metadata"]["num_terms"] == 2  # the config reached the generator
        assert row.agent_name == "reasoning_gym" and row.data_source == "reasoning_gym/basic_arithmetic"


def test_the_reward_is_the_tasks_own_score(data):
    for task, config in (("basic_arithmetic", SMALL), ("letter_counting", {"min_words": 1, "max_words": 3})):
        rows = data.build_rows("test", 12, seed=0, task=task, **config)
        score = rg.get_score_answer_fn(task)
        for row in rows:
            item = truth(row)["item"]
            right = compute_reward(row.reward_model, f"Let me think. <answer>{item['answer']}</answer>")
            assert right.score == score(item["answer"], item) == 1.0 and right.correct
            wrong = compute_reward(row.reward_model, "<answer>-12345.5</answer>")
            assert wrong.score == score("-12345.5", item) < 1.0 and not wrong.correct and wrong.formatted
            # the last <answer> counts (reasoning-gym's extract_answer); none at all scores 0
            last = compute_reward(
                row.reward_model, f"<answer>x</answer> so <answer>{item['answer']}</answer>"
            )
            assert last.correct and compute_reward(row.reward_model, item["answer"]).score == 0.0


def test_splits_are_seeded_and_disjoint(data):
    kw = {"task": "chain_sum", "min_terms": 3, "max_terms": 4}
    train = [r.prompt[-1]["content"] for r in data.build_rows("train", 60, seed=1, **kw)]
    assert train == [r.prompt[-1]["content"] for r in data.build_rows("train", 60, seed=1, **kw)]
    test = [r.prompt[-1]["content"] for r in data.build_rows("test", 60, seed=1, **kw)]
    other = [r.prompt[-1]["content"] for r in data.build_rows("train", 60, seed=2, **kw)]
    assert len(set(train) & set(test)) <= 1 and len(set(train) & set(other)) <= 1  # 3-4 terms: a big space


def test_worked_examples_come_before_every_question(data):
    ex = [["Calculate 12 + 31.", "12 + 31 = 43\n<answer>43</answer>"]]
    plain = data.build_rows("test", 3, task="basic_arithmetic", **SMALL)
    shown = data.build_rows("test", 3, task="basic_arithmetic", examples=ex, **SMALL)
    for a, b in zip(plain, shown, strict=True):
        assert b.prompt == [
            a.prompt[0],
            {"role": "user", "content": "Calculate 12 + 31."},
            {"role": "assistant", "content": "12 + 31 = 43\n<answer>43</answer>"},
            a.prompt[1],
        ]
        assert b.reward_model == a.reward_model  # the same items, scored the same
    with pytest.raises(ValueError, match=r"recipe.options.examples\[0\]: a \[question, answer\] pair"):
        data.build_rows("test", 1, examples=[["only a question"]])


def test_bad_options_are_named(data):
    with pytest.raises(ValueError, match="recipe.options.task: 'nope' is not a reasoning-gym dataset"):
        data.build_rows("train", 2, task="nope")
    with pytest.raises(ValueError, match="recipe.options for reasoning-gym's basic_arithmetic"):
        data.build_rows("train", 2, task="basic_arithmetic", bogus_key=1)
    with pytest.raises(ValueError, match="system_prompt"):
        data.build_rows("train", 2, system_prompt="nope")
    with pytest.raises(ValueError, match="split"):
        data.build_rows("dev", 2)
    with pytest.raises(ValueError, match="ground_truth must be JSON"):
        compute_reward({"style": "reasoning_gym", "ground_truth": "7"}, "<answer>7</answer>")


def test_with_the_calculator_an_episode_takes_steps(data, codec):
    (row,) = data.build_rows("train", 1, seed=5, task="basic_arithmetic", tool=True, **SMALL)
    item = truth(row)["item"]
    expression = item["metadata"]["expression"]
    traj, _ = play(
        codec,
        row,
        [format_tool_call("calculator", {"expression": expression}), f"<answer>{item['answer']}</answer>"],
    )
    assert row.agent_name == "reasoning_gym_tool" and "calculator" in row.prompt[0]["content"]
    assert len(traj.steps) == 2 and traj.num_tool_calls == 1 and traj.steps[-1].reward == 1.0


def test_agent_r1_data_writes_the_rows_in_the_public_layout(tmp_path):
    out = tmp_path / "rows.parquet"
    r = subprocess.run(
        [sys.executable, "-m", "agent_r1.cli", "data", "--recipe", "reasoning_gym", "--split", "test",
         "--num", "8", "--option", "task=chain_sum", "--option", "min_terms=2", "--option", "max_terms=2",
         "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    rows = load_rows(out)
    assert len(rows) == 8 and all(truth(x)["item"]["metadata"]["num_terms"] == 2 for x in rows)
    item = truth(rows[0])["item"]
    assert compute_reward(rows[0].reward_model, f"<answer>{item['answer']}</answer>").correct
    bad = subprocess.run(
        [sys.executable, "-m", "agent_r1.cli", "data", "--recipe", "reasoning_gym", "--option", "task",
         "--out", str(tmp_path / "x.parquet")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert bad.returncode == 2 and "--option 'task': expected KEY=VALUE" in bad.stderr
