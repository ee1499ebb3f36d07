"""Loaders for the public multi-hop QA datasets, read exactly as they ship:

- HotpotQA (``hotpot_train_v1.1.json``, ``hotpot_dev_distractor_v1.json``): a JSON list of
  ``{"_id", "question", "answer", "supporting_facts": [[title, sent_id]], "context": [[title,
  [sentences]]], "type", "level"}``;
- 2WikiMultihopQA (``train.json`` / ``dev.json``): the same layout (plus ``evidences``);
- MuSiQue (``musique_ans_v1.0_train.jsonl``): one object per line, ``{"id", "question", "answer",
  "answer_aliases", "paragraphs": [{"idx", "title", "paragraph_text", "is_supporting"}],
  "question_decomposition": [{"question", "answer", "paragraph_support_idx"}], "answerable"}``.

Either layout may come as a JSON list or as JSON lines. Each yields ``Example``s (the supporting
titles in order are the demonstration's searches) and its passages as a retrieval corpus. A
malformed row is an error naming the file, the row and the key.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent_r1.errors import AgentR1Error
from agent_r1.jsonfiles import iter_records
from agent_r1.retrieval.corpus import Passage


class DatasetError(AgentR1Error, ValueError):
    pass


@dataclass(frozen=True)
class Example:
    id: str
    question: str
    answers: tuple[str, ...]  # the answer first, then its aliases
    hops: tuple[str, ...]  # supporting passage titles, in reasoning order
    kind: str
    passages: tuple[Passage, ...]


def _need(row: Any, key: str, typ: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    if key not in row:
        raise DatasetError(f"{where}: missing key {key!r} (keys: {sorted(row)})")
    if not isinstance(row[key], typ):
        raise DatasetError(f"{where}: {key!r} must be {typ}, got {type(row[key]).__name__}")
    return row[key]


def join_sentences(sentences: list[str]) -> str:
    """A passage from its sentences as the dataset splits them: HotpotQA's later sentences carry
    their leading space (joined as they are), 2WikiMultihopQA's do not (joined with one)."""
    text = ""
    for s in sentences:
        text += s if not text or text[-1].isspace() or s[:1].isspace() else " " + s
    return text.strip()


def _hotpot(row: dict[str, Any], where: str) -> Example:
    """HotpotQA and 2WikiMultihopQA."""
    context = _need(row, "context", list, where)
    passages = []
    for i, item in enumerate(context):
        if not (
            isinstance(item, list)
            and len(item) == 2
            and isinstance(item[0], str)
            and isinstance(item[1], list)
        ):
            raise DatasetError(f"{where}: context[{i}] must be [title, [sentences]]")
        passages.append(Passage(item[0], item[0], join_sentences([str(s) for s in item[1]])))
    hops: list[str] = []
    for i, fact in enumerate(row.get("supporting_facts", [])):
        if not (isinstance(fact, list) and fact and isinstance(fact[0], str)):
            raise DatasetError(f"{where}: supporting_facts[{i}] must be [title, sentence_id]")
        if fact[0] not in hops:
            hops.append(fact[0])
    rid = row.get("_id", row.get("id"))
    if rid is None:
        raise DatasetError(f"{where}: missing key '_id'")
    return Example(
        str(rid), _need(row, "question", str, where), (str(_need(row, "answer", (str, int), where)),),
        tuple(hops), str(row.get("type", "bridge")), tuple(passages),
    )  # fmt: skip


def _musique(row: dict[str, Any], where: str) -> Example:
    paragraphs = _need(row, "paragraphs", list, where)
    passages, by_idx = [], {}
    for i, p in enumerate(paragraphs):
        if (
            not isinstance(p, dict)
            or not isinstance(p.get("title"), str)
            or not isinstance(p.get("paragraph_text"), str)
        ):
            raise DatasetError(f"{where}: paragraphs[{i}] needs string 'title' and 'paragraph_text'")
        idx = p.get("idx", i)
        by_idx[idx] = p
        passages.append(Passage(f"{p['title']}#{idx}", p["title"], p["paragraph_text"].strip()))
    hops: list[str] = []
    for step in row.get("question_decomposition", []):
        p = by_idx.get(step.get("paragraph_support_idx")) if isinstance(step, dict) else None
        if p is not None and p["title"] not in hops:
            hops.append(p["title"])
    if not hops:
        hops = [p["title"] for p in paragraphs if p.get("is_supporting")]
    aliases = row.get("answer_aliases", [])
    if not isinstance(aliases, list):
        raise DatasetError(f"{where}: 'answer_aliases' must be a list")
    answer = str(_need(row, "answer", (str, int), where))
    return Example(
        str(_need(row, "id", (str, int), where)), _need(row, "question", str, where),
        tuple(dict.fromkeys([answer, *map(str, aliases)])), tuple(hops), "musique", tuple(passages),
    )  # fmt: skip


def read_examples(path: str | Path) -> list[Example]:
    """Every answerable example of a HotpotQA / 2Wiki / MuSiQue file (layout detected per row)."""
    out = []
    for where, row in iter_records(path, DatasetError, "dataset file"):
        if isinstance(row, dict) and "paragraphs" in row:
            if row.get("answerable", True) is False:
                continue
            out.append(_musique(row, where))
        else:
            out.append(_hotpot(row, where))
    return out


def dataset_passages(paths: list[str | Path]) -> list[Passage]:
    """The passages of the datasets' examples, deduplicated by (title, text), as one corpus."""
    seen: dict[tuple[str, str], Passage] = {}
    for path in paths:
        for ex in read_examples(path):
            for p in ex.passages:
                seen.setdefault((p.title, p.text), p)
    out, ids = [], set()
    for p in seen.values():
        pid, k = p.id, 1
        while pid in ids:  # one title, several texts (different examples' versions)
            k += 1
            pid = f"{p.id}#{k}"
        ids.add(pid)
        out.append(Passage(pid, p.title, p.text))
    return out
