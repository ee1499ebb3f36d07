"""Writing step-record shards: one Arrow IPC file per writer per iteration, committed atomically.

Layout under a records directory (``run_dir/records``)::

    iter_000003/
        shard_w0001.arrow        Arrow IPC file (uncompressed by default: zero-copy mmap reads;
                                 lz4 / zstd buffer compression for slow filesystems or archives)
        shard_w0001.meta.json    rows, bytes, xxh3-64 checksum, policy versions -- its presence = committed
        manifest.json            the iteration's writers and totals -- written last

Each file goes temp -> fsync -> rename, so a reader sees a whole shard or none. Committing the
same content twice is a no-op; different content under a committed name is an error.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import xxhash

from agent_r1.errors import AgentR1Error
from agent_r1.records.schema import check_schema

COMPRESSIONS = ("none", "lz4", "zstd")


class ShardError(AgentR1Error, ValueError):
    """A shard or manifest is missing, truncated, corrupt, or does not match its metadata."""


@dataclass
class ShardMeta:
    name: str  # file name of the shard, e.g. shard_w0001.arrow
    rows: int
    bytes: int
    checksum: str  # xxh3-64 of the file, hex
    compression: str
    policy_version_min: int
    policy_version_max: int
    num_trajectories: int
    created: float


def iteration_dir(records_dir: str | Path, iteration: int) -> Path:
    return Path(records_dir) / f"iter_{iteration:06d}"


def iteration_dirs(folder: str | Path) -> dict[int, Path]:
    """The ``iter_N`` folders under ``folder`` (records, checkpoints) by N; other names ignored."""
    out = {}
    for p in Path(folder).glob("iter_*"):
        num = p.name[len("iter_") :]
        if num.isdigit() and p.is_dir():
            out[int(num)] = p
    return dict(sorted(out.items()))


def shard_name(writer: int | str) -> str:
    return f"shard_w{writer:04d}.arrow" if isinstance(writer, int) else f"shard_{writer}.arrow"


def _atomic_write(path: Path, data: bytes | memoryview) -> None:
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()


def _ipc_options(compression: str) -> pa.ipc.IpcWriteOptions:
    if compression not in COMPRESSIONS:
        raise ValueError(f"records.compression must be one of {COMPRESSIONS}, got {compression!r}")
    return pa.ipc.IpcWriteOptions(compression=None if compression == "none" else compression)


def serialize(table: pa.Table, compression: str = "zstd") -> pa.Buffer:
    """The shard bytes in memory (tests, small tables); ``write_shard`` streams to the file."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema, options=_ipc_options(compression)) as w:
        w.write_table(table, max_chunksize=64 * 1024)
    return sink.getvalue()


def file_checksum(path: Path) -> tuple[str, int]:
    """(xxh3-64 hex, size) of a file, hashed through a memory map (GB/s; no copy)."""
    size = path.stat().st_size
    if size == 0:
        return xxhash.xxh3_64_hexdigest(b""), 0
    with pa.memory_map(str(path)) as mm:
        return xxhash.xxh3_64_hexdigest(memoryview(mm.read_buffer(size))), size


def write_records_file(path: str | Path, steps: list[Any]) -> int:
    """Step records as one standalone Arrow IPC file (``rollout --out``, a chat's ``/save``),
    written atomically; returns the number of steps."""
    from agent_r1.records.schema import records_to_table

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    table = records_to_table(steps)
    _atomic_write(path, serialize(table, "none"))
    return table.num_rows


def write_shard(
    records_dir: str | Path, iteration: int, writer: int | str, table: pa.Table, compression: str = "none"
) -> ShardMeta:
    """Commit ``table`` as this writer's shard of ``iteration``; returns its metadata."""
    check_schema(table.schema, f"shard {shard_name(writer)} of iteration {iteration}")
    d = iteration_dir(records_dir, iteration)
    d.mkdir(parents=True, exist_ok=True)
    name = shard_name(writer)
    # stream the IPC file straight to a temp file (an in-memory buffer would cost a copy), fsync
    tmp = d / f".{name}.tmp.{os.getpid()}"
    with (
        pa.OSFile(str(tmp), "wb") as f,
        pa.ipc.new_file(f, table.schema, options=_ipc_options(compression)) as w,
    ):
        w.write_table(table, max_chunksize=64 * 1024)
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    checksum, size = file_checksum(tmp)
    meta_path = d / (name[: -len(".arrow")] + ".meta.json")
    if meta_path.exists():
        old = ShardMeta(**json.loads(meta_path.read_text()))
        tmp.unlink()
        if old.checksum == checksum and old.rows == table.num_rows and (d / name).exists():
            return old  # idempotent re-commit
        raise ShardError(
            f"{d / name}: already committed with different content (checksum {old.checksum} != {checksum})"
        )
    if (d / "manifest.json").exists():
        tmp.unlink()
        raise ShardError(f"{d}: iteration {iteration} is finalized; cannot add {name}")
    versions = table.column("policy_version")
    meta = ShardMeta(
        name=name,
        rows=table.num_rows,
        bytes=size,
        checksum=checksum,
        compression=compression,
        policy_version_min=int(pc.min(versions).as_py() or 0),
        policy_version_max=int(pc.max(versions).as_py() or 0),
        num_trajectories=len(pc.unique(table.column("trajectory_id"))),
        created=time.time(),
    )
    os.replace(tmp, d / name)
    _atomic_write(meta_path, _json_bytes(asdict(meta)))  # commit point
    return meta


def committed_shards(records_dir: str | Path, iteration: int) -> list[ShardMeta]:
    d = iteration_dir(records_dir, iteration)
    return [ShardMeta(**json.loads(p.read_text())) for p in sorted(d.glob("shard_*.meta.json"))]


def drop_damaged_shards(records_dir: str | Path, iteration: int) -> list[str]:
    """Remove the committed shards of ``iteration`` whose file is missing, truncated or corrupt
    (size or checksum against its metadata), each with its metadata, and the iteration's manifest
    if one was written: what the caller knows was never trained is generated again. Returns what
    was wrong with each, naming the file."""
    d = iteration_dir(records_dir, iteration)
    dropped = []
    for meta in committed_shards(records_dir, iteration):
        path = d / meta.name
        if not path.exists():
            why = "missing"
        elif path.stat().st_size != meta.bytes:
            why = f"truncated or overwritten: {path.stat().st_size} bytes, its metadata says {meta.bytes}"
        elif file_checksum(path)[0] != meta.checksum:
            why = "checksum mismatch: the file is corrupt"
        else:
            continue
        dropped.append(f"{path}: {why}")
        path.unlink(missing_ok=True)
        (d / f"{Path(meta.name).stem}.meta.json").unlink(missing_ok=True)
    if dropped:
        (d / "manifest.json").unlink(missing_ok=True)
    return dropped


def finalize_iteration(
    records_dir: str | Path, iteration: int, expected_writers: int | None = None
) -> dict[str, Any]:
    """Write the iteration manifest from the committed shards (idempotent)."""
    d = iteration_dir(records_dir, iteration)
    shards = committed_shards(records_dir, iteration)
    if expected_writers is not None and len(shards) != expected_writers:
        raise ShardError(f"{d}: {len(shards)} shards committed, expected {expected_writers}")
    manifest = {
        "iteration": iteration,
        "shards": {s.name: asdict(s) for s in shards},
        "rows": sum(s.rows for s in shards),
        "num_trajectories": sum(s.num_trajectories for s in shards),
        "policy_version_min": min((s.policy_version_min for s in shards), default=0),
        "policy_version_max": max((s.policy_version_max for s in shards), default=0),
    }
    path = d / "manifest.json"
    if path.exists():
        old = json.loads(path.read_text())
        if old["shards"] == manifest["shards"]:
            return old
        raise ShardError(f"{path}: iteration already finalized with different shards")
    d.mkdir(parents=True, exist_ok=True)
    manifest["created"] = time.time()
    _atomic_write(path, _json_bytes(manifest))
    return manifest
