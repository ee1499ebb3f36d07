import asyncio
import json
import random

import pytest
from scripted import ScriptedPolicy

from agent_r1.agent.flow import AGENTS, FlowConfig
from agent_r1.agent_tools import TOOLS
from agent_r1.agent_tools.calculator import evaluate
from agent_r1.data.rows import RowError
from agent_r1.rewards import REWARDS
from recipes import RECIPES, load_recipe


def test_every_recipe_registers_its_agent_and_builds_rows():
    for name in RECIPES:
        data = load_recipe(name).data
        rows = data.build_rows(split="train", num=3, seed=1)
        assert len(rows) == 3 and all(r.agent_name in AGENTS for r in rows)
        assert all(r.reward_model["style"] in REWARDS for r in rows)
        assert all(isinstance(t, str) and t for t in data.corpus(num=2)), name


def test_arithmetic_problems_are_exact_and_scale_with_difficulty():
    data = load_recipe("arithmetic_tool").data
    rng = random.Random(3)
    for d in range(1, 7):
        for _ in range(100):
            p = data.make_problem(rng, d)
            assert evaluate(p.expression) == p.answer and p.answer >= 0
            assert p.question.count(". Then ") == d
    with pytest.raises(ValueError, match="difficulty"):
        data.make_problem(rng, 0)


def test_arithmetic_splits_are_disjoint_and_seeded():
    data = load_recipe("arithmetic_tool").data
    a = [r.prompt[-1]["content"] for r in data.build_rows("train", 50, seed=0)]
    assert a == [r.prompt[-1]["content"] for r in data.build_rows("train", 50, seed=0)]
    assert not set(a) & {r.prompt[-1]["content"] for r in data.build_rows("test", 50, seed=0)}


def test_arithmetic_demonstration_replays_to_full_reward(codec):
    """The recipe's demonstration, played through its own agent, env, calculator and reward."""
    data = load_recipe("arithmetic_tool").data
    for row in data.build_rows("test", 5, seed=2, difficulty=3):
        p = data.Problem(
            row.prompt[-1]["content"], row.extra_info["expression"], int(row.reward_model["ground_truth"])
        )
        demo = data.demonstration(p)
        policy = ScriptedPolicy(codec, [demo[2]["content"], demo[4]["content"]])
        traj = asyncio.run(
            AGENTS.get(row.agent_name)
            .build(policy, codec, FlowConfig(max_action_tokens=300))
            .run(row, "t", "g")
        )
        assert [s.reward for s in traj.steps] == [0.0, 1.0]
        assert traj.steps[0].feedback == demo[3]["content"]  # the calculator gave the reference answer
        # the second observation is the demonstration's chat, token for token
        assert traj.steps[1].obs_token_ids == codec.encode_chat(demo[:4], [TOOLS.get("calculator")().schema])


def test_gsm8k_reader(tmp_path):
    data = load_recipe("gsm8k").data
    probs = data.read_gsm8k(data.SAMPLE)
    assert len(probs) >= 20 and all(p["ground_truth"].lstrip("-").isdigit() for p in probs)
    good = tmp_path / "test.jsonl"
    good.write_text(json.dumps({"question": "1+1?", "answer": "1+1=2\n#### 2"}) + "\n")
    assert data.build_rows(path=str(good))[0].reward_model["ground_truth"] == "2"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"question": "q", "answer": "#### 1,000"}]), tmp_path / "t.parquet")
    assert data.read_gsm8k(tmp_path / "t.parquet")[0]["ground_truth"] == "1000"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "no final"}) + "\n")
    with pytest.raises(RowError, match=r"bad.jsonl row 0: key 'answer' has no '#### N'"):
        data.read_gsm8k(bad)


def test_gsm8k_tool_episode_with_calculator(codec):
    data = load_recipe("gsm8k_tool").data
    row = data.build_rows(num=1)[0]  # 3 packs x 12 pencils - 9 = 27
    from agent_r1.agent.tool_calls import format_tool_call

    policy = ScriptedPolicy(codec, [format_tool_call("calculator", {"expression": "3*12-9"}), "#### 27"])
    traj = asyncio.run(AGENTS.get("gsm8k_tool").build(policy, codec).run(row, "t", "g"))
    assert traj.steps[0].feedback.split("\n")[1] == "27" and traj.steps[-1].reward == 1.0


def test_every_recipe_meets_the_protocol_and_a_broken_one_is_named():
    import types

    import pytest

    from recipes import RECIPES, Recipe, RecipeError

    for name in RECIPES:
        r = load_recipe(name)
        assert r.name == name and callable(r.build_rows) and callable(r.corpus)
        assert all(isinstance(t, str) for t in r.tools) and len(r.tool_schemas()) == len(r.tools)
    assert load_recipe("webshop").has_server and not load_recipe("gsm8k").has_server
    assert load_recipe("gsm8k").demonstrations is None and load_recipe("hotpotqa").passages is not None
    broken = types.ModuleType("data")
    broken.build_rows = lambda **kw: []
    with pytest.raises(RecipeError, match=r"recipes/mine/data.py: .* missing: corpus, TOOLS"):
        Recipe.of("mine", broken)
    broken.corpus, broken.TOOLS = (lambda: []), "calculator"
    with pytest.raises(RecipeError, match="TOOLS must be a list of tool names, got 'calculator'"):
        Recipe.of("mine", broken)
    with pytest.raises(ValueError, match="rollout.env_server: recipe gsm8k has no environment service"):
        load_recipe("gsm8k").server()


def test_longtail_job_answers_pending_until_polled_and_the_demonstration_scores(codec):
    """arithmetic_longtail: the job answers "pending" for a row's first polls - 1 calls, each after
    the row's latency, then the result; the demonstrator's polls end in a full reward."""
    data = load_recipe("arithmetic_longtail").data
    rows = data.build_rows("train", 400, seed=0, delay_s=0.0, max_delay_s=0.0)
    polls = [r.extra_info["polls"] for r in rows]
    assert max(polls) == data.MAX_STEPS - 1 and polls.count(1) > len(polls) / 2  # a heavy tail
    assert (
        data.build_rows("train", 5, seed=0)[0].extra_info == data.build_rows("train", 5, seed=0)[0].extra_info
    )
    row = next(r for r in rows if r.extra_info["polls"] == 3)
    (demo,) = data.demonstrations([row], tool_rate=1.0)
    assert len(demo) == 4
    traj = asyncio.run(
        AGENTS.get(row.agent_name)
        .build(ScriptedPolicy(codec, demo), codec, FlowConfig(max_steps=8))
        .run(row, "t", "g")
    )
    assert [s.feedback.count(data.PENDING) for s in traj.steps] == [1, 1, 0, 0]
    assert traj.steps[-1].reward == 1.0 and len(traj.steps) == 4
