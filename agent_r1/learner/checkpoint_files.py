"""Checkpoint integrity: a SHA-256 per file written at save and checked at load, finite weights
after loading, and a disk-full error that says so.

A checkpoint directory is complete when it holds ``agent_r1_state.json`` (it is renamed into place
whole); ``checksums.json`` beside it lists every other file's digest, so a flipped byte, a
truncated shard or a file written over after the save is found before it is loaded.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import shutil
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from agent_r1.errors import AgentR1Error, full_disk

log = logging.getLogger("agent_r1.checkpoint")

CHECKSUMS = "checksums.json"
_CHUNK = 8 << 20


class CheckpointError(AgentR1Error, RuntimeError):
    """A checkpoint cannot be used; the message names the file or parameter and why."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _files(d: Path) -> list[Path]:
    return sorted(p for p in d.rglob("*") if p.is_file() and p.name != CHECKSUMS)


def _digests(d: Path, files: list[Path]) -> dict[str, str]:
    with ThreadPoolExecutor(8) as ex:  # hashlib releases the GIL: shards hash in parallel
        return dict(zip((str(p.relative_to(d)) for p in files), ex.map(_sha256, files), strict=True))


def write_checksums(d: Path) -> None:
    (d / CHECKSUMS).write_text(json.dumps(_digests(d, _files(d)), indent=1, sort_keys=True))


def verify_checksums(d: Path) -> None:
    """Raise CheckpointError naming the first missing or changed file; a checkpoint written before
    checksums existed is accepted with a warning."""
    listed = d / CHECKSUMS
    if not listed.exists():
        log.warning("checkpoint %s has no %s: not verified", d, CHECKSUMS)
        return
    try:
        expected = json.loads(listed.read_text())
    except ValueError as e:
        raise CheckpointError(f"{listed} is corrupt: {e}") from None
    missing = [name for name in expected if not (d / name).is_file()]
    if missing:
        raise CheckpointError(f"checkpoint {d}: file {d / missing[0]} is missing")
    actual = _digests(d, [d / name for name in sorted(expected)])
    for name in sorted(expected):
        if actual[name] != expected[name]:
            raise CheckpointError(f"checkpoint {d}: file {d / name} does not match its checksum (corrupted)")


def first_nonfinite(named: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """Name of the first tensor holding a NaN or an infinity, else None."""
    for name, t in named:
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return name
    return None


# a write that failed with less than this free where it wrote is a full disk, whatever it raised:
# torch's checkpoint writer loses the errno (``basic_ios::clear: iostream error``, ``unexpected pos``)
FULL_BELOW_BYTES = 64 << 20


def _free_bytes(path: Path) -> int:
    return shutil.disk_usage(next((p for p in [path, *path.parents] if p.exists()), Path("/"))).free


def no_space(e: BaseException, path: Path | None = None) -> bool:
    """Whether ``e`` (or an exception it was raised from) is a full disk (ENOSPC / EDQUOT), or,
    with ``path``, whether the write there failed with (almost) nothing left free on its
    filesystem."""
    return full_disk(e) is not None or (path is not None and _free_bytes(path) < FULL_BELOW_BYTES)


def no_space_error(path: Path, e: BaseException) -> OSError:
    free = _free_bytes(path)
    return OSError(
        errno.ENOSPC,
        f"no space left on device writing {path} ({free >> 20} MiB free there; the partial "
        f"write was removed): free space or point trainer.run_dir at a larger filesystem "
        f"[{type(e).__name__}: {e}]",
    )
