"""Records from a JSON-lines file or a JSON list, each with where it came from.

Public datasets ship both ways (HotpotQA as one JSON list, MuSiQue, corpora and PaSa query files as
JSON lines). ``iter_records`` streams JSON lines (a 21M-passage corpus is never loaded whole) and
names the file and line of anything that is not JSON, in the caller's error type.
"""

from __future__ import annotations

import json
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
    with path.open(encoding="utf-8") as f:
        head = f.read(4096)
        f.seek(0)
        if head.lstrip().startswith("["):
            try:
                rows = json.load(f)
            except json.JSONDecodeError as e:
                raise error(f"{path}: not JSON ({e})") from None
            yield from ((f"{path} row {n}", r) for n, r in enumerate(rows))
            return
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{n}", json.loads(line)
            except json.JSONDecodeError as e:
                raise error(f"{path}:{n}: not JSON ({e})") from None
