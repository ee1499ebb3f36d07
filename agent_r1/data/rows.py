"""Data rows: what a prompt looks like on disk (parquet), validated with row and key named.

Columns: ``prompt`` (chat messages), ``agent_name`` (registered agent), ``reward_model``
(``{"style": ..., "ground_truth": ...}``), ``env_kwargs`` (JSON object as a string, overrides the
agent's env defaults), ``data_source``; optional ``extra_info`` (JSON string).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

ROLES = ("system", "user", "assistant", "tool")
REQUIRED = ("prompt", "agent_name", "reward_model", "env_kwargs", "data_source")

ROW_SCHEMA = pa.schema(
    [
        ("data_source", pa.string()),
        ("agent_name", pa.string()),
        ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
        ("env_kwargs", pa.string()),
        ("extra_info", pa.string()),
    ]
)


class RowError(ValueError):
    """A data row is invalid; the message names the file, row and key."""


@dataclass
class DataRow:
    prompt: list[dict[str, str]]
    agent_name: str
    reward_model: dict[str, Any]
    data_source: str
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    extra_info: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "data_source": self.data_source,
            "agent_name": self.agent_name,
            "prompt": self.prompt,
            "reward_model": {
                "style": self.reward_model["style"],
                "ground_truth": str(self.reward_model["ground_truth"]),
            },
            "env_kwargs": json.dumps(self.env_kwargs, sort_keys=True),
            "extra_info": json.dumps(self.extra_info, sort_keys=True),
        }


def _json_object(value: Any, key: str, where: str) -> dict[str, Any]:
    if value is None or value == "":
        return {}
    if isinstance(value, dict):
        return value
    if not isinstance(value, str):
        raise RowError(f"{where}: key {key!r} must be a JSON object string, got {type(value).__name__}")
    try:
        obj = json.loads(value)
    except json.JSONDecodeError as e:
        raise RowError(f"{where}: key {key!r} is not valid JSON: {e.msg} at position {e.pos}") from None
    if not isinstance(obj, dict):
        raise RowError(f"{where}: key {key!r} must be a JSON object, got {type(obj).__name__}")
    return obj


def validate_row(raw: dict[str, Any], where: str = "row") -> DataRow:
    """Check one raw row (as read from parquet) and return it typed; raises RowError naming the key."""
    missing = [k for k in REQUIRED if raw.get(k) is None]
    if missing:
        raise RowError(f"{where}: missing key(s) {missing}")
    prompt = raw["prompt"]
    if not isinstance(prompt, list) or not prompt:
        raise RowError(f"{where}: key 'prompt' must be a non-empty list of messages")
    for i, m in enumerate(prompt):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise RowError(
                f"{where}: key 'prompt[{i}]' must be {{'role': one of {list(ROLES)}, 'content': str}}, got {m!r}"
            )
    if not isinstance(raw["agent_name"], str) or not raw["agent_name"]:
        raise RowError(f"{where}: key 'agent_name' must be a non-empty string")
    rm = raw["reward_model"]
    if not isinstance(rm, dict) or not isinstance(rm.get("style"), str) or rm.get("ground_truth") is None:
        raise RowError(
            f"{where}: key 'reward_model' must be {{'style': str, 'ground_truth': ...}}, got {rm!r}"
        )
    return DataRow(
        prompt=[{"role": m["role"], "content": m["content"]} for m in prompt],
        agent_name=raw["agent_name"],
        reward_model=dict(rm),
        data_source=str(raw["data_source"]),
        env_kwargs=_json_object(raw["env_kwargs"], "env_kwargs", where),
        extra_info=_json_object(raw.get("extra_info"), "extra_info", where),
    )


def rows_to_table(rows: list[DataRow]) -> pa.Table:
    return pa.Table.from_pylist([r.to_dict() for r in rows], schema=ROW_SCHEMA)


def write_rows(rows: list[DataRow], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    pq.write_table(rows_to_table(rows), tmp)
    tmp.replace(path)
    return path


def load_rows(path: str | Path, agents: Any = None) -> list[DataRow]:
    """Read and validate every row; ``agents`` (a registry) also checks that agent_name exists."""
    path = Path(path)
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowInvalid) as e:
        raise RowError(f"{path}: cannot read parquet: {e}") from None
    rows = []
    for i, raw in enumerate(table.to_pylist()):
        row = validate_row(raw, f"{path} row {i}")
        if agents is not None and row.agent_name not in agents:
            raise RowError(
                f"{path} row {i}: key 'agent_name': unknown agent {row.agent_name!r}; known: {agents.names()}"
            )
        rows.append(row)
    return rows
