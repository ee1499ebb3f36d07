"""Passage corpora in the layouts retrieval corpora ship in (one JSON object per line):

- ``{"id": ..., "contents": "\"Title\"\\ntext"}`` (Search-R1 / FlashRAG wiki dumps: the first line
  of ``contents`` is the title, often quoted);
- ``{"id" | "_id" | "docid": ..., "title": ..., "text": ...}`` (DPR / BEIR style).

A malformed line is an error naming the file, the line and what is wrong.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from agent_r1.errors import AgentR1Error
from agent_r1.jsonfiles import iter_records


class CorpusError(AgentR1Error, ValueError):
    pass


@dataclass(frozen=True)
class Passage:
    id: str
    title: str
    text: str

    @property
    def contents(self) -> str:
        """The Search-R1 ``contents`` form: quoted title, newline, text."""
        return f'"{self.title}"\n{self.text}' if self.title else self.text

    def to_json(self) -> dict[str, str]:
        return {"id": self.id, "contents": self.contents}


def passage_from_json(obj: object, where: str = "") -> Passage:
    if not isinstance(obj, dict):
        raise CorpusError(f"{where}: a passage must be a JSON object, got {type(obj).__name__}")
    pid = next((obj[k] for k in ("id", "_id", "docid") if k in obj), None)
    if pid is None:
        raise CorpusError(f"{where}: passage has no 'id' (or '_id' / 'docid'); keys {sorted(obj)}")
    if "contents" in obj:
        contents = obj["contents"]
        if not isinstance(contents, str):
            raise CorpusError(f"{where}: 'contents' must be a string")
        title, _, text = contents.partition("\n")
        if not text:  # no title line
            title, text = "", contents
        return Passage(str(pid), title.strip().strip('"'), text.strip())
    if "text" in obj:
        if not isinstance(obj["text"], str) or not isinstance(obj.get("title", ""), str):
            raise CorpusError(f"{where}: 'title' and 'text' must be strings")
        return Passage(str(pid), obj.get("title", "").strip(), obj["text"].strip())
    raise CorpusError(
        f"{where}: passage needs 'contents' or 'text' (layouts {{id, contents}} / {{id, title, text}}); "
        f"keys {sorted(obj)}"
    )


def read_corpus(path: str | Path) -> Iterator[Passage]:
    for where, obj in iter_records(path, CorpusError, "corpus"):
        yield passage_from_json(obj, where)


def write_corpus(passages: Iterable[Passage], path: str | Path) -> int:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with path.open("w", encoding="utf-8") as f:
        for p in passages:
            f.write(json.dumps(p.to_json(), ensure_ascii=False) + "\n")
            n += 1
    return n
