"""Multi-hop QA with a search tool (HotpotQA, 2WikiMultihopQA, MuSiQue; offline: a generated
world). Rows carry the question and the answer aliases; the reward is exact match after the
official answer normalisation; the retrieval corpus is the world's (or the dataset's) passages.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from agent_r1.agent.tool_calls import format_tool_call
from agent_r1.data.rows import DataRow
from agent_r1.retrieval.corpus import Passage
from recipes.hotpotqa import world as W
from recipes.hotpotqa.loaders import Example, dataset_passages, read_examples

AGENT = "hotpotqa"
TOOLS = ["search"]
SYSTEM = (
    "Answer the question. Use the search tool to look up one fact at a time, then give the final "
    "answer as <answer>...</answer>."
)
TEST_FRACTION = 0.2  # of the world's works: their questions are held out


def world_examples(split: str, seed: int = 0, hops: Any = (2,), kinds: Any = ("bridge",)) -> list[Example]:
    """The world's questions of ``split``. A fifth of the works are held out: for each, one of its
    questions (seeded choice) is a test question and its other questions stay in training, so a
    test question is new while its names were seen (a tiny model cannot emit a name it never
    produced); a work with a single question type is held out whole."""
    w = W.make_world(seed)
    titles = list(w.works)
    rng = random.Random(seed)
    rng.shuffle(titles)
    held = set(titles[int(len(titles) * (1 - TEST_FRACTION)) :])
    per_title: dict[str, list[W.Question]] = {}
    comparisons: list[W.Question] = []
    for kind in kinds:
        if kind == "comparison":
            for part in (sorted(set(titles) - held), sorted(held)):
                comparisons += [
                    dataclasses.replace(q, id=f"{q.id}|{'test' if part[0] in held else 'train'}")
                    for q in W.questions(w, 2, kind, part)
                ]
            continue
        for h in hops:
            for q in W.questions(w, int(h), kind, titles):
                per_title.setdefault(q.hops[0], []).append(q)
    qs: list[W.Question] = []
    for t in titles:
        options = per_title.get(t, [])
        if t not in held:
            qs += options if split == "train" else []
        elif options:
            pick = random.Random(f"{seed}/{t}").randrange(len(options))
            qs += [options[pick]] if split == "test" else [q for i, q in enumerate(options) if i != pick]
    qs += [q for q in comparisons if q.id.endswith(f"|{split}")]
    random.Random(f"{seed}/{split}").shuffle(qs)
    return [Example(q.id, q.question, (q.answer,), q.hops, q.kind, ()) for q in qs]


def to_row(ex: Example, split: str) -> DataRow:
    return DataRow(
        prompt=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": ex.question}],
        agent_name=AGENT,
        reward_model={"style": "qa_em", "ground_truth": list(ex.answers)},
        data_source="hotpotqa",
        env_kwargs={},
        extra_info={
            "id": ex.id,
            "question": ex.question,
            "hops": list(ex.hops),
            "type": ex.kind,
            "split": split,
        },
    )


def build_rows(
    split: str = "train", num: int | None = None, seed: int = 0, path: str | None = None,
    hops: Any = (2,), kinds: Any = ("bridge",),
) -> list[DataRow]:  # fmt: skip
    """Rows of ``split``: the dataset file at ``path`` (HotpotQA / 2Wiki / MuSiQue layout), or the
    seeded world's questions (``hops`` 2-4 for bridge questions; ``kinds`` bridge / comparison)."""
    exs = read_examples(path) if path else world_examples(split, seed, hops, kinds)
    return [to_row(ex, split) for ex in exs[:num]]


def passages(seed: int = 0, paths: list[str] | None = None, **options: Any) -> list[Passage]:
    """The retrieval corpus: the datasets' passages when reading files, else the world's."""
    if paths:
        return dataset_passages(paths)
    return W.make_world(seed).passages()


def answer_text(answer: str) -> str:
    return f"<answer>{answer}</answer>"


def demonstrations(rows: list[DataRow], seed: int = 0, hop_rate: float = 1.0) -> list[list[str]]:
    """A search per hop (the supporting titles in order), then the answer. With ``hop_rate`` < 1 a
    noisy demonstrator: the rest of the time it stops after the first search and answers with what
    that passage named (wrong for a multi-hop question), so RL has to learn that the later hops pay."""
    if not 0.0 <= hop_rate <= 1.0:
        raise ValueError(f"hop_rate must be in [0, 1], got {hop_rate}")
    rng = random.Random(seed)
    out = []
    for row in rows:
        chain = row.extra_info["hops"]
        answer = row.reward_model["ground_truth"][0]
        if rng.random() < hop_rate or len(chain) < 2:
            out.append([format_tool_call("search", {"query": q}) for q in chain] + [answer_text(answer)])
        else:
            out.append([format_tool_call("search", {"query": chain[0]}), answer_text(chain[1])])
    return out


def corpus(num: int = 0, seed: int = 0) -> list[str]:
    """Tokenizer texts: the world's passages, questions and demonstration turns, and the system
    prompt with the tool schema often enough that every word of it is one token."""
    from agent_r1.agent.chat import render_message, render_system
    from agent_r1.agent.tool_calls import format_tool_responses
    from agent_r1.agent_tools import TOOLS as REGISTRY

    w = W.make_world(seed)
    texts = [f"{p.title}: {p.text}" for p in w.passages()]
    for split in ("train", "test"):
        for ex in world_examples(split, seed, hops=(2, 3, 4), kinds=("bridge", "comparison")):
            texts.append(ex.question)
            texts += [format_tool_call("search", {"query": q}) for q in ex.hops] + [
                answer_text(ex.answers[0])
            ]
    texts.append(format_tool_responses(["Doc 1(Title: x) y"]))
    schemas = [REGISTRY.get(t)().schema for t in TOOLS]
    return texts + [render_message("system", render_system(SYSTEM, schemas))] * 300
