"""Records from a JSON-lines file or a JSON list, each with where it came from.

Public datasets ship both ways (HotpotQA as one JSON list, MuSiQue, corpora and PaSa query files as
JSON lines). ``iter_records`` streams JSON lines (a 21M-passage corpus is never loaded whole) and
names the file and line of anything that is not JSON, in the caller's error type.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def iter_records(
    path: str | Path, error: type[Exception] = ValueError, what: str = "file"
) -> Iterator[tuple[str, Any]]:
    """``(where, record)`` for every record: ``where`` is ``path:line`` (JSON lines) or
    ``path row n`` (a JSON list, 0-based); blank lines are skipped."""
    path = Path(path)
    if not path.exists():
        raise error(f"{what} {path} does not exist")
    with path.open("rb") as f:  # bytes: a line that is not UTF-8 is named, not a decoder traceback
        head = f.read(4096)
        f.seek(0)
        if head.lstrip().startswith(b"["):
            data = f.read()
            try:
                rows = json.loads(_text(data, f"{path}", error))
            except json.JSONDecodeError as e:
                raise error(f"{path}: not JSON ({e})") from None
            yield from ((f"{path} row {n}", r) for n, r in enumerate(rows))
            return
        for n, raw in enumerate(f, 1):
            line = _text(raw, f"{path}:{n}", error)
            if not line.strip():
                continue
            try:
                yield f"{path}:{n}", json.loads(line)
            except json.JSONDecodeError as e:
                raise error(f"{path}:{n}: not JSON ({e})") from None


def _text(data: bytes, where: str, error: type[Exception]) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{where}: not UTF-8 text (byte {e.start}: {data[e.start : e.start + 1]!r})") from None


def atomic_write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True))
    os.replace(tmp, path)


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())
