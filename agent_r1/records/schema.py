"""StepRecord <-> Arrow, defined once (docs/architecture.md, "The step-level MDP").

A step record is one MDP transition: the full observation as token ids, the action as sampled
(ids, logprobs, mask), what the environment said back, the reward and termination.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any

import pyarrow as pa


class FinishReason(StrEnum):
    """Why an action (one generation) ended. SGLang reports stop / length / abort."""

    STOP = "stop"  # a stop token or stop string was produced
    LENGTH = "length"  # max_new_tokens or the context limit was hit
    ABORT = "abort"  # the request was aborted (server pause, client abort)
    ERROR = "error"  # the engine failed this request

    def is_truncated(self) -> bool:
        return self is FinishReason.LENGTH

    def is_error(self) -> bool:
        return self in (FinishReason.ABORT, FinishReason.ERROR)


STEP_SCHEMA = pa.schema(
    [
        pa.field("trajectory_id", pa.string(), nullable=False),
        pa.field("group_id", pa.string(), nullable=False),
        pa.field("step_index", pa.int32(), nullable=False),
        pa.field("policy_version", pa.int64(), nullable=False),
        pa.field("obs_token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("prefix_len", pa.int32(), nullable=False),
        pa.field("action_token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("action_logprobs", pa.list_(pa.float32()), nullable=False),
        pa.field("action_mask", pa.list_(pa.int8()), nullable=False),
        pa.field("feedback", pa.string(), nullable=False),
        pa.field("reward", pa.float64(), nullable=True),
        pa.field("process_reward", pa.list_(pa.float64()), nullable=False),
        pa.field("done", pa.bool_(), nullable=False),
        pa.field("truncated", pa.bool_(), nullable=False),
        pa.field("finish_reason", pa.string(), nullable=False),
        pa.field("info", pa.string(), nullable=False),  # JSON object
    ],
    metadata={"agent_r1.schema": "step_record", "agent_r1.schema_version": "1"},
)


# Images: a step lists the images of its observation (SHA-256 of the encoded bytes, in the order
# of their pad runs); the bytes are stored once per trajectory, at the step whose observation
# shows the image first. Only tables with images carry these columns; the bytes stay zero-copy.
IMAGE_FIELDS = {
    f.name: f
    for f in [
        pa.field("images", pa.list_(pa.string())),
        pa.field(
            "image_data",
            pa.list_(pa.struct([pa.field("hash", pa.string()), pa.field("data", pa.large_binary())])),
        ),
    ]
}

# Columns a table may carry besides STEP_SCHEMA: critic values (per step / per token), reference and
# teacher logprobs, and what the advantage stage writes (per step or per token).
EXTRA_FIELDS = {
    f.name: f
    for f in [
        pa.field("value", pa.float64()),
        pa.field("token_values", pa.list_(pa.float32())),
        pa.field("ref_logprobs", pa.list_(pa.float32())),
        pa.field("teacher_logprobs", pa.list_(pa.float32())),
        pa.field("advantage", pa.float64()),
        pa.field("return", pa.float64()),
        pa.field("token_advantages", pa.list_(pa.float32())),
        pa.field("token_returns", pa.list_(pa.float32())),
        *IMAGE_FIELDS.values(),
    ]
}


def check_schema(schema: pa.Schema, where: str = "table") -> None:
    """Raise ValueError naming ``where`` unless ``schema`` = STEP_SCHEMA columns (same types, same
    order) followed by known extra columns."""
    names = schema.names
    missing = [n for n in STEP_SCHEMA.names if n not in names]
    if missing:
        raise ValueError(f"{where}: not a step-record table: missing columns {missing}")
    for f in STEP_SCHEMA:
        got = schema.field(f.name).type
        if not got.equals(f.type):
            raise ValueError(f"{where}: column {f.name!r} has type {got}, expected {f.type}")
    for n in names:
        if n in STEP_SCHEMA.names:
            continue
        if n not in EXTRA_FIELDS:
            raise ValueError(f"{where}: unexpected column {n!r}; known extras: {sorted(EXTRA_FIELDS)}")
        if not schema.field(n).type.equals(EXTRA_FIELDS[n].type):
            raise ValueError(
                f"{where}: column {n!r} has type {schema.field(n).type}, expected {EXTRA_FIELDS[n].type}"
            )


@dataclass
class StepRecord:
    trajectory_id: str
    group_id: str
    step_index: int
    obs_token_ids: list[int]
    action_token_ids: list[int]
    action_logprobs: list[float]
    action_mask: list[int]
    policy_version: int = 0
    prefix_len: int = 0  # leading obs tokens equal to the previous step's obs + action
    feedback: str = ""
    reward: float | None = None  # None until scored
    process_reward: list[float | None] = field(default_factory=list)  # one per tool call
    done: bool = False
    truncated: bool = False
    finish_reason: str = FinishReason.STOP.value
    info: dict[str, Any] = field(default_factory=dict)
    images: list[str] = field(default_factory=list)  # the observation's images (hashes, in order)
    image_data: dict[str, bytes] = field(default_factory=dict, repr=False)  # those first seen here

    def __post_init__(self) -> None:
        n = len(self.action_token_ids)
        if len(self.action_logprobs) != n or len(self.action_mask) != n:
            raise ValueError(
                f"step {self.trajectory_id}/{self.step_index}: action ids ({n}), logprobs "
                f"({len(self.action_logprobs)}) and mask ({len(self.action_mask)}) differ in length"
            )
        if not 0 <= self.prefix_len <= len(self.obs_token_ids):
            raise ValueError(
                f"step {self.trajectory_id}/{self.step_index}: prefix_len {self.prefix_len} outside "
                f"[0, {len(self.obs_token_ids)}]"
            )
        FinishReason(self.finish_reason)  # raises on free text
        stray = set(self.image_data) - set(self.images)
        if stray:
            raise ValueError(
                f"step {self.trajectory_id}/{self.step_index}: image data for {sorted(stray)[0][:12]}, "
                "which its observation does not show"
            )

    @property
    def num_trainable_tokens(self) -> int:
        return sum(self.action_mask)


@dataclass
class Trajectory:
    """The steps of one episode, in order."""

    trajectory_id: str
    group_id: str
    steps: list[StepRecord] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def total_reward(self) -> float:
        return sum(s.reward or 0.0 for s in self.steps)

    @property
    def num_tool_calls(self) -> int:
        return sum(len(s.process_reward) for s in self.steps)


def records_to_table(records: list[StepRecord]) -> pa.Table:
    """A table of the records; the image columns only when some step shows an image."""
    cols: dict[str, list[Any]] = {f.name: [getattr(r, f.name) for r in records] for f in fields(StepRecord)}
    cols["info"] = [json.dumps(i, sort_keys=True, ensure_ascii=False) for i in cols["info"]]
    # a None item (a tool with no opinion) stays a null inside the list
    cols["process_reward"] = [[None if x is None else float(x) for x in pr] for pr in cols["process_reward"]]
    table = pa.Table.from_pydict({f.name: cols[f.name] for f in STEP_SCHEMA}, schema=STEP_SCHEMA)
    if any(r.images for r in records):
        data = [[{"hash": h, "data": b} for h, b in r.image_data.items()] for r in records]
        table = table.append_column(
            IMAGE_FIELDS["images"], pa.array(cols["images"], IMAGE_FIELDS["images"].type)
        )
        table = table.append_column(
            IMAGE_FIELDS["image_data"], pa.array(data, IMAGE_FIELDS["image_data"].type)
        )
    return table


def records_from_table(table: pa.Table) -> list[StepRecord]:
    """StepRecords of a table (extra columns such as ``advantage`` are left out; images kept)."""
    check_schema(table.schema)
    names = STEP_SCHEMA.names + [n for n in IMAGE_FIELDS if n in table.column_names]
    out = []
    for row in table.select(names).to_pylist():
        row["info"] = json.loads(row["info"])
        if "image_data" in row:
            row["image_data"] = {d["hash"]: d["data"] for d in row["image_data"] or []}
            row["images"] = row["images"] or []
        out.append(StepRecord(**row))
    return out


def table_images(table: pa.Table, verify: bool = True) -> dict[tuple[str, str], pa.Buffer]:
    """The image bytes of a table by (trajectory id, hash), zero-copy views of its buffers; each
    checked against its hash (``verify``) and every step's reference resolved, or ValueError."""
    if "image_data" not in table.column_names:
        return {}
    import hashlib

    out: dict[tuple[str, str], pa.Buffer] = {}
    tids = table.column("trajectory_id").to_pylist()
    for i, items in enumerate(table.column("image_data")):  # ListScalars: the buffers are not copied
        for item in items.values if items.is_valid else []:
            h, buf = item["hash"].as_py(), item["data"].as_buffer()
            if verify and hashlib.sha256(memoryview(buf)).hexdigest() != h:
                raise ValueError(
                    f"row {i} (trajectory {tids[i]}): image {h[:12]}'s bytes do not match its hash"
                )
            out[(tids[i], h)] = buf
    for i, refs in enumerate(table.column("images").to_pylist()):
        for h in refs or []:
            if (tids[i], h) not in out:
                raise ValueError(
                    f"row {i} (trajectory {tids[i]}): image {h[:12]} is not stored in the trajectory"
                )
    return out
