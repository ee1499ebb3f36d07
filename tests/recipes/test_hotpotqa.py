"""The hotpotqa recipe: answer normalisation, the dataset loaders on hand-written files in the
public layouts, the generated world, and the agent (rewrite observation, forced search, up to 4
concurrent searches) with demonstrations replayed to full reward."""

from __future__ import annotations

import json

import pytest
from scripted import index_services, play

from agent_r1.agent.tool_calls import format_tool_call
from agent_r1.rewards import compute_reward
from agent_r1.rewards.qa import exact_match, f1_score, normalize_answer
from recipes import load_recipe
from recipes.hotpotqa.loaders import DatasetError, dataset_passages, read_examples

D = load_recipe("hotpotqa").data


# ---- answer normalisation (the official HotpotQA / SQuAD rules), hand-worked ----------------------
@pytest.mark.parametrize(
    "raw,norm",
    [
        ("The Eiffel Tower!", "eiffel tower"),
        ("  an   apple, a pear ", "apple pear"),
        ("Theatre", "theatre"),  # 'the' inside a word stays
        ("U.S.A.", "usa"),
        ("A", ""),
    ],
)
def test_normalize_answer(raw, norm):
    assert normalize_answer(raw) == norm


def test_em_f1_and_reward_by_hand():
    assert exact_match("the Beatles", "Beatles") and not exact_match("Beatles band", "Beatles")
    # pred tokens {beatles, band}, truth {beatles}: precision 1/2, recall 1 -> F1 2/3
    assert f1_score("Beatles band", "The Beatles") == pytest.approx(2 / 3)
    assert f1_score("yes", "no") == 0.0 and f1_score("no", "no") == 1.0
    rm = {"style": "qa_em", "ground_truth": ["New York City", "NYC"]}
    r = compute_reward(rm, "I looked it up. <answer>nyc</answer>")
    assert (r.score, r.correct, r.prediction, r.details["metrics"]) == (
        1.0,
        True,
        "nyc",
        {"em": 1.0, "f1": 1.0},
    )
    r = compute_reward(rm, "<answer>New York</answer>")
    assert r.score == 0.0 and r.details["metrics"]["f1"] == pytest.approx(0.8)  # P 1, R 2/3
    assert compute_reward(rm, "New York City").formatted is False  # no <answer> tag: no answer
    assert compute_reward(rm, "<answer>a</answer> <answer>NYC</answer>").correct  # the last one counts


# ---- loaders on small files in the public layouts ------------------------------------------------
HOTPOT = [
    {
        "_id": "5a8b57f25542995d1e6f1371",
        "question": "Were Scott Derrickson and Ed Wood of the same nationality?",
        "answer": "yes",
        "supporting_facts": [["Scott Derrickson", 0], ["Ed Wood", 0]],
        "context": [
            ["Ed Wood", ["Edward Davis Wood Jr. was an American filmmaker.", " He made films."]],
            ["Scott Derrickson", ["Scott Derrickson is an American director."]],
            ["Tyler Bates", ["Tyler Bates is a composer."]],
        ],
        "type": "comparison",
        "level": "hard",
    }
]
MUSIQUE = {
    "id": "2hop__1_2",
    "question": "Who founded the label of the singer of Song X?",
    "answer": "Jane Roe",
    "answer_aliases": ["J. Roe"],
    "answerable": True,
    "paragraphs": [
        {"idx": 0, "title": "Distractor", "paragraph_text": "Unrelated.", "is_supporting": False},
        {
            "idx": 1,
            "title": "Label Y",
            "paragraph_text": "Label Y was founded by Jane Roe.",
            "is_supporting": True,
        },
        {
            "idx": 2,
            "title": "Song X",
            "paragraph_text": "Song X was sung by Ann on Label Y.",
            "is_supporting": True,
        },
    ],
    "question_decomposition": [
        {"id": 1, "question": "Song X >> label", "answer": "Label Y", "paragraph_support_idx": 2},
        {"id": 2, "question": "#1 >> founded by", "answer": "Jane Roe", "paragraph_support_idx": 1},
    ],
}


def test_hotpotqa_and_2wiki_layout(tmp_path):
    f = tmp_path / "hotpot_dev_distractor_v1.json"
    f.write_text(json.dumps(HOTPOT))
    (ex,) = read_examples(f)
    assert ex.id == "5a8b57f25542995d1e6f1371" and ex.answers == ("yes",) and ex.kind == "comparison"
    assert ex.hops == ("Scott Derrickson", "Ed Wood")
    assert ex.passages[0].text == "Edward Davis Wood Jr. was an American filmmaker. He made films."
    rows = D.build_rows("test", path=str(f))
    assert rows[0].reward_model == {"style": "qa_em", "ground_truth": ["yes"]}
    assert rows[0].prompt[-1]["content"] == HOTPOT[0]["question"]
    assert [p.title for p in dataset_passages([f])] == ["Ed Wood", "Scott Derrickson", "Tyler Bates"]


# 2WikiMultihopQA's dev.json: the HotpotQA layout, but its sentences carry no leading space
TWOWIKI = [
    {
        "_id": "8813f87c0bdd11eba7f7acde48001122",
        "type": "compositional",
        "question": "Who is the mother of the director of film Polish-Russian War?",
        "context": [
            ["Xawery Żuławski", ["Xawery Żuławski (born 22 December 1971) is a Polish film director.",
                                 "In 1995 he graduated from the National Film School in Łódź.",
                                 "He is the son of actress Małgorzata Braunek."]],
            ["Polish-Russian War (film)", ["Polish-Russian War is a 2009 Polish film.",
                                           "It was directed by Xawery Żuławski."]],
        ],
        "supporting_facts": [["Polish-Russian War (film)", 1], ["Xawery Żuławski", 2]],
        "evidences": [["Polish-Russian War", "director", "Xawery Żuławski"]],
        "answer": "Małgorzata Braunek",
    }
]  # fmt: skip


def test_2wiki_sentences_are_joined_with_a_space(tmp_path):
    f = tmp_path / "dev.json"
    f.write_text(json.dumps(TWOWIKI, ensure_ascii=False))
    (ex,) = read_examples(f)
    assert ex.hops == ("Polish-Russian War (film)", "Xawery Żuławski") and ex.answers == (
        "Małgorzata Braunek",
    )
    assert ex.passages[0].text == (
        "Xawery Żuławski (born 22 December 1971) is a Polish film director. In 1995 he graduated from the"
        " National Film School in Łódź. He is the son of actress Małgorzata Braunek."
    )
    assert (
        ex.passages[1].text == "Polish-Russian War is a 2009 Polish film. It was directed by Xawery Żuławski."
    )


def test_musique_layout_jsonl_with_aliases_and_decomposition_order(tmp_path):
    f = tmp_path / "musique_ans_v1.0_dev.jsonl"
    unanswerable = dict(MUSIQUE, id="x", answerable=False)
    f.write_text(json.dumps(MUSIQUE) + "\n" + json.dumps(unanswerable) + "\n")
    (ex,) = read_examples(f)  # the unanswerable one is skipped
    assert ex.answers == ("Jane Roe", "J. Roe") and ex.hops == ("Song X", "Label Y")
    assert compute_reward(D.to_row(ex, "test").reward_model, "<answer>j roe</answer>").correct


@pytest.mark.parametrize(
    "row,needle",
    [
        ({"question": "q", "answer": "a", "context": []}, "row 0: missing key '_id'"),
        ({"_id": "1", "answer": "a", "context": []}, "row 0: missing key 'question'"),
        (
            {"_id": "1", "question": "q", "answer": "a", "context": [["t", "not a list"]]},
            "row 0: context\\[0\\] must be",
        ),
        (
            {"id": "1", "question": "q", "answer": "a", "paragraphs": [{"title": 1}]},
            "row 0: paragraphs\\[0\\] needs",
        ),
    ],
)
def test_malformed_rows_are_named(tmp_path, row, needle):
    f = tmp_path / "bad.json"
    f.write_text(json.dumps([row]))
    with pytest.raises(DatasetError, match=f"bad.json {needle}"):
        read_examples(f)


# ---- the generated world -------------------------------------------------------------------------
def test_world_is_seeded_and_splits_are_disjoint():
    a = D.build_rows("train", 50, seed=0)
    assert [r.prompt[-1] for r in a] == [r.prompt[-1] for r in D.build_rows("train", 50, seed=0)]
    assert [r.prompt[-1] for r in a] != [r.prompt[-1] for r in D.build_rows("train", 50, seed=1)]
    train, test = D.build_rows("train", seed=0), D.build_rows("test", seed=0)
    assert (len(train), len(test)) == (432, 48)
    # held-out questions are new; their works appear in training under the other question type
    assert not {r.prompt[-1]["content"] for r in train} & {r.prompt[-1]["content"] for r in test}
    train_works = {r.extra_info["hops"][0] for r in train}
    assert all(r.extra_info["hops"][0] in train_works for r in test)
    rows = D.build_rows("test", seed=0, hops=[2, 3, 4], kinds=["bridge", "comparison"])
    assert {len(r.extra_info["hops"]) for r in rows} == {2, 3, 4}
    assert {r.extra_info["type"] for r in rows} == {"bridge", "comparison"}


@pytest.fixture(scope="module")
def world_retriever(tmp_path_factory):
    return index_services(D.passages(0), tmp_path_factory.mktemp("idx") / "world")


def _run(services, codec, row, script, **flow):
    return play(codec, row, script, services, **{"max_steps": 8, "max_action_tokens": 200, **flow})


def test_demonstrations_replay_to_full_reward(codec, world_retriever):
    """Every hop length and kind: the demonstrator's searches find each next name, EM = 1."""
    rows = D.build_rows("test", 24, seed=0, hops=[2, 3, 4], kinds=["bridge", "comparison"])
    for row, script in zip(rows, D.demonstrations(rows, hop_rate=1.0), strict=True):
        traj, _ = _run(world_retriever, codec, row, script, max_obs_tokens=4096)
        assert traj.metrics["success"] == 1.0, (row.extra_info, script)
        assert len(traj.steps) == len(row.extra_info["hops"]) + 1
        assert traj.steps[-1].info["reward"]["metrics"] == {"em": 1.0, "f1": 1.0}


def test_noisy_demonstrator_stops_early_and_fails(codec, world_retriever):
    rows = D.build_rows("train", 40, seed=0)
    scripts = D.demonstrations(rows, seed=0, hop_rate=0.5)
    short = [(r, s) for r, s in zip(rows, scripts, strict=True) if len(s) == 2]
    assert 5 < len(short) < 35
    traj, _ = _run(world_retriever, codec, *short[0])
    assert (
        traj.metrics["success"] == 0.0
        and traj.steps[-1].info["reward"]["prediction"] == short[0][0].extra_info["hops"][1]
    )


def test_rewrite_observation_forced_search_and_concurrent_calls(codec, world_retriever):
    row = D.build_rows("test", 1, seed=0)[0]
    title, person = row.extra_info["hops"]
    calls = "\n".join(
        format_tool_call("search", {"query": q}) for q in [title, person, "festival", "born", "x"]
    )
    script = ["<answer>guess</answer>", calls, "<answer>done</answer>"]
    traj, policy = _run(world_retriever, codec, row, script, max_action_tokens=1000, max_obs_tokens=4096)
    s0, s1, s2 = traj.steps
    # forced first search: an answer at step 1 is an error observation, not the end
    assert not s0.done and s0.info["num_tool_errors"] == 1 and "search first" in s0.feedback
    text1 = codec.decode(s1.obs_token_ids)
    assert "Errors:\nError: search first" in text1
    # 5 calls: 4 run (concurrently), the 5th is refused; the observation is rebuilt from state
    assert s1.info["num_tool_calls"] == 5 and s1.info["num_tool_errors"] == 1
    text2 = codec.decode(s2.obs_token_ids)
    assert f'Searches so far: "{title}"; "{person}"; "festival"; "born"' in text2
    assert (
        text2.count(f"Question: {row.prompt[-1]['content']}") == 1 and f'- {title}: "{title}" is a' in text2
    )
    # the system / tool prefix is the same at every step, and the flow recorded the shared prefix
    prefix = codec.encode_system(D.SYSTEM, [TOOLS_SCHEMA()])
    assert all(s.obs_token_ids[: len(prefix)] == prefix for s in traj.steps)
    assert s2.prefix_len >= len(prefix)


def TOOLS_SCHEMA():
    from agent_r1.agent_tools import TOOLS

    return TOOLS.get("search")().schema


def test_passages_shrink_to_the_token_budget_and_the_prefix_is_never_cut(codec, world_retriever):
    from agent_r1.agent.env import make_env

    row = D.build_rows("test", 1, seed=0)[0]
    big = make_env("hotpotqa", codec, world_retriever, max_prompt_tokens=100_000)
    small = make_env("hotpotqa", codec, world_retriever, max_prompt_tokens=520)
    for env in (big, small):
        env.reset(prompt=row.prompt)
        env.passages = {f"p{i}": (f"T{i}", "word " * 30) for i in range(8)}
        env._render()
    prefix = small.history.prefix_ids
    view_big, view_small = big.context.view(big.history), small.context.view(small.history)
    assert len(view_big) > 900 and len(view_small) <= 520
    assert view_small[: len(prefix)] == prefix and view_big[: len(prefix)] == prefix
    shown = small.history.turns[0].text
    assert "T7:" in shown and "T0:" not in shown  # the newest passages are kept
    assert shown.startswith(f"Question: {row.prompt[-1]['content']}")
