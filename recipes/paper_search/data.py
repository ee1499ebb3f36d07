"""Paper search (PaperScout as a POMDP): find every paper relevant to a query with ``search`` and
``expand`` over a citation graph. Rows: PaSa-style query files over a user's paper graph, or the
seeded generated graph's topics (held-out topics for the test split). Per-step process rewards
come from the selector; recall and F1 of the found set are the metrics.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from agent_r1.agent.tool_calls import format_tool_call
from agent_r1.data.rows import DataRow
from agent_r1.jsonfiles import iter_records
from agent_r1.retrieval.corpus import Passage
from recipes.paper_search.graph import GraphError, load_graph

AGENT = "paper_search"
TOOLS = ["paper_search", "expand"]
SYSTEM = (
    "Find all papers relevant to the query. Search for them, expand relevant papers to see their "
    "references and citations, and reply Done. when you have found them all."
)
TEMPLATES = [
    "Find papers about {}.",
    "Which papers study {}?",
    "Search for research on {}.",
    "List work on {}.",
    "Papers on {}, please.",
]
TEST_FRACTION = 0.4
FINAL = "Done."


def _row(question: str, relevant: list[str], split: str, **extra: Any) -> DataRow:
    return DataRow(
        prompt=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        agent_name=AGENT,
        reward_model={"style": "paper_recall", "ground_truth": relevant},
        data_source="paper_search",
        env_kwargs={},
        extra_info={"question": question, "split": split, **extra},
    )


def read_queries(path: str | Path, graph: Any) -> list[DataRow]:
    """PaSa-style query files (JSON lines or a JSON list): ``{"question", "answer": [titles]}``
    and/or ``"answer_arxiv_id": [ids]``; relevant papers are matched to the graph by id, else by
    title (case-insensitive). A row naming no paper of the graph is an error (file, row, key)."""
    by_title = {p.title.lower().strip(): p.id for p in graph.papers.values()}
    out = []
    for where, r in iter_records(path, GraphError, "query file"):
        if not isinstance(r, dict) or not isinstance(r.get("question"), str):
            raise GraphError(f"{where}: needs a string 'question'")
        ids = [str(i) for i in r.get("answer_arxiv_id", []) if str(i) in graph.papers]
        ids += [
            by_title[t.lower().strip()]
            for t in r.get("answer", [])
            if isinstance(t, str) and t.lower().strip() in by_title
        ]
        ids = list(dict.fromkeys(ids))
        if not ids:
            raise GraphError(f"{where}: no paper of 'answer' / 'answer_arxiv_id' is in the paper graph")
        out.append(_row(r["question"], ids, "file", hubs=[]))
    return out


def build_rows(
    split: str = "train", num: int | None = None, seed: int = 0, path: str | None = None,
    graph: str | None = None,
) -> list[DataRow]:  # fmt: skip
    """Rows of ``split``: a query file at ``path`` over the graph ``graph`` (JSON lines of papers),
    or the generated graph's topics in five phrasings. Of 40% of the topics one phrasing (seeded)
    is held out for the test split and the others are trained on: a test query is new while its
    papers' ids were seen (a tiny model cannot emit an id it never produced)."""
    g = load_graph(graph, seed)
    if path:
        return read_queries(path, g)[:num]
    if graph:
        raise GraphError("a user's paper graph needs its query file: recipe.train_path / test_path")
    topics = list(g.topics)
    random.Random(seed).shuffle(topics)
    held = set(topics[int(len(topics) * (1 - TEST_FRACTION)) :])
    rows = []
    for phrase in topics:
        t = g.topics[phrase]
        pick = random.Random(f"{seed}/{phrase}").randrange(len(TEMPLATES)) if phrase in held else -1
        for i, tmpl in enumerate(TEMPLATES):
            if (split == "test") == (i == pick):
                rows.append(_row(tmpl.format(phrase), t["relevant"], split, hubs=t["hubs"], phrase=phrase))
    random.Random(f"{seed}/{split}").shuffle(rows)
    return rows[:num]


def passages(
    seed: int = 0, paths: list[str] | None = None, graph: str | None = None, **options: Any
) -> list[Passage]:
    """The paper index's corpus: every paper (id, title, abstract)."""
    return load_graph(graph, seed).passages()


def demonstrations(rows: list[DataRow], seed: int = 0, expand_rate: float = 1.0) -> list[list[str]]:
    """Search the topic, expand both hub papers (their references hold the rest), then ``Done.``;
    with ``expand_rate`` < 1 the rest of the time it stops after the search (recall 3/8)."""
    if not 0.0 <= expand_rate <= 1.0:
        raise ValueError(f"expand_rate must be in [0, 1], got {expand_rate}")
    rng = random.Random(seed)
    out = []
    for row in rows:
        search = format_tool_call("search", {"query": row.extra_info["phrase"]})
        if rng.random() < expand_rate:
            expand = "\n".join(format_tool_call("expand", {"paper_id": h}) for h in row.extra_info["hubs"])
            out.append([search, expand, FINAL])
        else:
            out.append([search, FINAL])
    return out


def corpus(num: int = 0, seed: int = 0) -> list[str]:
    from agent_r1.agent.chat import render_message, render_system
    from agent_r1.agent_tools import TOOLS as REGISTRY

    g = load_graph(None, seed)
    texts = [f"[{p.id}] {p.title}. {p.abstract}" for p in g.papers.values()]
    for split in ("train", "test"):
        rows = build_rows(split, seed=seed)
        texts += [r.prompt[-1]["content"] for r in rows[:200]]
        texts += [t for d in demonstrations(rows[:200], seed) for t in d]
    schemas = [REGISTRY.get(t)().schema for t in TOOLS]
    return texts + [render_message("system", render_system(SYSTEM, schemas))] * 300
