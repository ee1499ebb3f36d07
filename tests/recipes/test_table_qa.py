"""table_qa: the WikiTableQuestions layout read from hand-written files, the ``wtq`` answer check
against hand-worked cases, and the recipe's demonstrations played through its agent, the real
sandbox and pandas to full reward; the sandbox's failures reach the model as ``Error:`` turns."""

from __future__ import annotations

import asyncio

import pytest
from scripted import ScriptedPolicy

from agent_r1.agent.flow import AGENTS, FlowConfig
from agent_r1.agent.tool_calls import format_tool_call
from agent_r1.agent_tools.sandbox import isolation
from agent_r1.rewards import compute_reward
from recipes import load_recipe

data = load_recipe("table_qa").data


def write_wtq(root, tsv: str, tables: dict[str, str]):
    (root / "data").mkdir()
    for rel, text in tables.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "data" / "training.tsv").write_text(tsv)
    return root / "data" / "training.tsv"


def test_the_wikitablequestions_layout_is_read_as_it_ships(tmp_path):
    """Two rows as the dataset writes them: escapes in the question (``\\n``, ``\\p``) and a list
    target, tables at their ``context`` beside ``data/``."""
    tsv = (
        "id\tutterance\tcontext\ttargetValue\n"
        "nt-0\twhat was the last year?\tcsv/204-csv/590.csv\t2004\n"
        "nt-1\twhich a\\pb teams\\nwon?\tcsv/203-csv/7.csv\tLions|Owls\n"
    )
    path = write_wtq(
        tmp_path, tsv, {"csv/204-csv/590.csv": "Year,Team\n2004,Lions\n", "csv/203-csv/7.csv": "T\nLions\n"}
    )
    rows = data.build_rows("train", None, path=str(path))
    assert [r.reward_model["ground_truth"] for r in rows] == [["2004"], ["Lions", "Owls"]]
    assert rows[1].prompt[-1]["content"].startswith("which a|b teams\nwon?\ntable.csv:\nT\nLions")
    assert rows[0].env_kwargs["tool_kwargs"]["python"]["files"] == {"table.csv": "Year,Team\n2004,Lions\n"}
    assert rows[0].extra_info["context"] == "csv/204-csv/590.csv" and rows[1].extra_info["id"] == "nt-1"


def test_a_malformed_split_is_named(tmp_path):
    bad = write_wtq(tmp_path, "id\tquestion\tcontext\ttargetValue\n", {})
    with pytest.raises(
        ValueError, match="header .*WikiTableQuestions' is id, utterance, context, targetValue"
    ):
        data.build_rows("train", None, path=str(bad))
    bad.write_text("id\tutterance\tcontext\ttargetValue\nnt-0\tq?\tcsv/1-csv/1.csv\t3\n")
    with pytest.raises(ValueError, match=r"training.tsv:2: table csv/1-csv/1.csv not found"):
        data.build_rows("train", None, path=str(bad))
    bad.write_text("id\tutterance\tcontext\ttargetValue\nnt-0\tq?\n")
    with pytest.raises(ValueError, match=r"training.tsv:2: 2 tab-separated fields, expected 4"):
        data.build_rows("train", None, path=str(bad))


def test_the_offline_world_round_trips_through_the_layout():
    a = data.build_rows("test", 20, seed=4)
    assert [r.prompt for r in a] == [r.prompt for r in data.build_rows("test", 20, seed=4)]  # seeded
    made = data.world("test", 20, 4)
    assert [r.reward_model["ground_truth"] for r in a] == [ex.answers for ex, _ in made]


@pytest.mark.parametrize(
    ("answer", "truth", "correct"),
    [
        ("\\boxed{46}", ["46"], True),
        ("\\boxed{46.0}", ["46"], True),  # numbers by value
        ("\\boxed{the Lions}", ["Lions"], True),  # strings normalised
        ("\\boxed{Owls|Lions}", ["Lions", "Owls"], True),  # a list is a multiset
        ("\\boxed{Lions}", ["Lions", "Owls"], False),
        ("\\boxed{Lions|Lions}", ["Lions", "Owls"], False),
        ("\\boxed{45}", ["46"], False),
        ("46", ["46"], False),  # no boxed answer
    ],
)
def test_the_wtq_answer_check(answer, truth, correct):
    r = compute_reward({"style": "wtq", "ground_truth": truth}, answer)
    assert r.correct is correct and r.score == float(correct)


def test_demonstrations_replay_to_full_reward_through_the_sandbox(codec):
    """Each question kind's code runs in the sandbox with pandas on the row's own table: the result
    the model is shown is the answer, and the boxed answer scores 1."""
    rows = data.build_rows("test", 12, seed=1)
    assert {r.prompt[-1]["content"].split()[0] for r in rows} == {"What", "How", "Which"}
    demos = data.demonstrations(rows, seed=0, tool_rate=1.0)

    async def play_all():
        async def one(row, demo):
            policy = ScriptedPolicy(codec, demo)
            flow = AGENTS.get(row.agent_name).build(policy, codec, FlowConfig(max_action_tokens=400))
            return await flow.run(row, "t", "g")

        return await asyncio.gather(*(one(r, d) for r, d in zip(rows, demos, strict=True)))

    for row, traj in zip(rows, asyncio.run(play_all()), strict=True):
        assert [s.reward for s in traj.steps] == [0.0, 1.0], traj.steps[0].feedback
        assert traj.steps[0].feedback.split("\n")[1] == "|".join(row.reward_model["ground_truth"])


@pytest.mark.skipif(not isolation()["own_user"], reason="the process limit needs a sandbox user (root) here")
def test_a_broken_program_is_an_error_turn_and_the_episode_goes_on(codec):
    row = data.build_rows("test", 1, seed=2)[0]
    bomb = format_tool_call("python", {"code": "import os\nwhile True:\n    os.fork()"})
    loop = format_tool_call("python", {"code": "while True: pass"})
    policy = ScriptedPolicy(codec, [bomb, loop, data.answer_text(row.reward_model["ground_truth"])])
    row.env_kwargs["tool_kwargs"]["python"].update(cpu_s=1, wall_s=5)  # beside the row's table
    flow = AGENTS.get(row.agent_name).build(policy, codec, FlowConfig(max_action_tokens=400))
    traj = asyncio.run(flow.run(row, "t", "g"))
    s0, s1, s2 = traj.steps
    assert "Error: python: BlockingIOError: cannot start another process" in s0.feedback
    assert "Error: python: CPU time limit (1 s) exceeded" in s1.feedback
    assert s2.reward == 1.0 and traj.metrics["success"] == 1.0
