"""Reading committed step-record shards: memory-mapped, verified, selected by rank or group.

Every shard is checked before use: its size and xxh3-64 checksum against the metadata written at commit, its
Arrow footer, schema and row count. Any mismatch raises ``ShardError`` naming the file; nothing is
silently consumed. With ``compression="none"`` the columns are zero-copy views of the mapping.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from agent_r1.records.schema import check_schema
from agent_r1.records.shard import ShardError, ShardMeta, file_checksum, iteration_dir, iteration_dirs


def group_hash(group_ids: list[str]) -> np.ndarray:
    """Stable (process- and platform-independent) hash of group ids -> uint32."""
    return np.array([zlib.crc32(g.encode()) for g in group_ids], dtype=np.uint32)


def resolve_records_dir(path: str | Path) -> Path:
    """Accept a run directory (holding ``records/``) or the records directory itself."""
    p = Path(path)
    return p / "records" if (p / "records").is_dir() else p


class RecordStore:
    def __init__(self, records_dir: str | Path):
        self.dir = resolve_records_dir(records_dir)
        if not self.dir.is_dir():
            raise FileNotFoundError(
                f"no records directory at {self.dir} (give a run directory or its records/ folder)"
            )

    def iterations(self, finalized_only: bool = True) -> list[int]:
        return [
            i
            for i, p in iteration_dirs(self.dir).items()
            if not finalized_only or (p / "manifest.json").exists()
        ]

    def readable(
        self, strict: bool = False, newest_first: bool = False, **read: Any
    ) -> Iterator[tuple[int, pa.Table | None, str | None]]:
        """``(iteration, table, None)`` for every finalized iteration, in order; a damaged one (a
        shard or manifest that fails its checks) is ``(iteration, None, why)``, ``why`` naming the
        file, and the rest are still read. ``strict``: a damaged iteration raises instead."""
        its = self.iterations()
        for it in reversed(its) if newest_first else its:
            try:
                yield it, self.read(it, **read), None
            except ShardError as e:
                if strict:
                    raise
                yield it, None, str(e)

    def manifest(self, iteration: int) -> dict[str, Any]:
        path = iteration_dir(self.dir, iteration) / "manifest.json"
        if not path.exists():
            have = self.iterations()
            span = (
                ", ".join(map(str, have))
                if len(have) <= 4
                else f"{len(have)} of them, {have[0]} to {have[-1]}"
            )
            raise ShardError(
                f"{self.dir}: no finalized iteration {iteration} (have {span})"
                if not path.parent.exists()
                else f"{path}: iteration {iteration} is not finalized (no manifest)"
            )
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ShardError(f"{path}: corrupt manifest: {e}") from None

    def shards(self, iteration: int) -> list[ShardMeta]:
        return [ShardMeta(**m) for _, m in sorted(self.manifest(iteration)["shards"].items())]

    def read_shard(
        self, iteration: int, meta: ShardMeta, verify: bool = True, columns: list[str] | None = None
    ) -> pa.Table:
        path = iteration_dir(self.dir, iteration) / meta.name
        if not path.exists():
            raise ShardError(f"{path}: shard listed in the manifest is missing")
        size = path.stat().st_size
        if size != meta.bytes:
            raise ShardError(f"{path}: truncated or overwritten: {size} bytes, manifest says {meta.bytes}")
        if verify:
            checksum, _ = file_checksum(path)
            if checksum != meta.checksum:
                raise ShardError(
                    f"{path}: checksum mismatch ({checksum} != {meta.checksum}): the file is corrupt"
                )
        mm = pa.memory_map(str(path))
        try:
            table = pa.ipc.open_file(mm).read_all()
        except (pa.ArrowInvalid, OSError) as e:
            raise ShardError(f"{path}: not a readable Arrow IPC file: {e}") from None
        try:
            check_schema(table.schema, str(path))
        except ValueError as e:
            raise ShardError(str(e)) from None
        if table.num_rows != meta.rows:
            raise ShardError(f"{path}: {table.num_rows} rows, manifest says {meta.rows}")
        return table.select(columns) if columns else table

    def read(
        self,
        iteration: int,
        rank: int = 0,
        world: int = 1,
        by: str = "shard",
        columns: list[str] | None = None,
        verify: bool = True,
    ) -> pa.Table:
        """This rank's part of an iteration: whole shards round-robin (``by="shard"``) or whole
        groups (``by="group"``: a group never straddles ranks). Groups are ordered by their stable
        hash and dealt round-robin, so every rank gets floor or ceil(groups / world) of them (a
        rank never starves while another has two) and the split is the same on every rank."""
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside world of {world}")
        shards = self.shards(iteration)
        if by == "shard":
            picked = [m for i, m in enumerate(shards) if i % world == rank]
            tables = [self.read_shard(iteration, m, verify, columns) for m in picked]
        elif by == "group":
            cols = columns and sorted(set(columns) | {"group_id"})
            tables = [self.read_shard(iteration, m, verify, cols) for m in shards]
            groups = sorted({g for t in tables for g in pc.unique(t.column("group_id")).to_pylist()})
            dealt = [g for _, g in sorted(zip(group_hash(groups).tolist(), groups, strict=True))]
            mine = pa.array(dealt[rank::world], pa.string())
            tables = [t.filter(pc.is_in(t.column("group_id"), value_set=mine)) for t in tables]
            tables = [t.select(columns) if columns else t for t in tables]
        else:
            raise ValueError(f"by must be 'shard' or 'group', got {by!r}")
        if not tables:
            return (
                self.read_shard(iteration, shards[0], verify, columns).slice(0, 0) if shards else pa.table({})
            )
        return pa.concat_tables(tables, promote_options="default")  # shards with and without images
