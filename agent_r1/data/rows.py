"""Data rows: what a prompt looks like on disk (parquet), validated with row and key named.

Columns: ``prompt`` (chat messages), ``agent_name`` (registered agent), ``reward_model``
(``{"style": ..., "ground_truth": ...}``), ``env_kwargs`` (JSON object as a string, overrides the
agent's env defaults), ``data_source``; optional ``extra_info`` (JSON string).

Images (vision-language rows) are stored as verl's multimodal datasets store them: each message's
content is a string with an ``<image>`` placeholder where a picture goes, and the row's ``images``
column lists the pictures in order as ``{"bytes", "path"}``. In memory a row's messages carry
them as content parts (``{"type": "image", "image": bytes}``, text parts between), the form the
chat codec renders.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from agent_r1.errors import AgentR1Error

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
IMAGE_PLACEHOLDER = "<image>"
IMAGES_FIELD = pa.field("images", pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())])))


class RowError(AgentR1Error, ValueError):
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
        """The row as stored: image parts become ``<image>`` placeholders + the ``images`` list."""
        images: list[dict[str, Any]] = []
        prompt = [{"role": m["role"], "content": _flatten(m["content"], images)} for m in self.prompt]
        out = {
            "data_source": self.data_source,
            "agent_name": self.agent_name,
            "prompt": prompt,
            "reward_model": {
                "style": self.reward_model["style"],
                "ground_truth": str(self.reward_model["ground_truth"]),
            },
            "env_kwargs": json.dumps(self.env_kwargs, sort_keys=True),
            "extra_info": json.dumps(self.extra_info, sort_keys=True),
        }
        if images:
            out["images"] = images
        return out


def _flatten(content: Any, images: list[dict[str, Any]]) -> str:
    """A message content as stored: text, with ``<image>`` for each image part (appended to ``images``)."""
    if isinstance(content, str):
        return content
    from agent_r1.vision.images import load_image, part_image

    text = []
    for p in content:
        src = part_image(p)
        if src is None:
            text.append(p.get("text", ""))
        else:
            images.append({"bytes": load_image(src).data, "path": None})
            text.append(IMAGE_PLACEHOLDER)
    return "".join(text)


def _with_images(prompt: list[dict[str, Any]], images: list[Any], where: str) -> list[dict[str, Any]]:
    """Stored messages + the row's images -> messages whose content holds image parts."""
    n = sum(m["content"].count(IMAGE_PLACEHOLDER) for m in prompt)
    if n != len(images):
        raise RowError(
            f"{where}: {n} {IMAGE_PLACEHOLDER} placeholder(s) in 'prompt' but {len(images)} in 'images'"
        )
    it = iter(images)
    out = []
    for i, m in enumerate(prompt):
        if IMAGE_PLACEHOLDER not in m["content"]:
            out.append(m)
            continue
        parts: list[dict[str, Any]] = []
        for j, chunk in enumerate(m["content"].split(IMAGE_PLACEHOLDER)):
            if j:
                im = next(it)
                data = im.get("bytes") if isinstance(im, dict) else None
                if not data:
                    raise RowError(f"{where}: key 'images': an image without bytes (prompt[{i}])")
                parts.append({"type": "image", "image": data})
            if chunk:
                parts.append({"type": "text", "text": chunk})
        out.append({"role": m["role"], "content": parts})
    return out


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
    prompt = [{"role": m["role"], "content": m["content"]} for m in prompt]
    if raw.get("images"):
        prompt = _with_images(prompt, raw["images"], where)
    return DataRow(
        prompt=prompt,
        agent_name=raw["agent_name"],
        reward_model=dict(rm),
        data_source=str(raw["data_source"]),
        env_kwargs=_json_object(raw["env_kwargs"], "env_kwargs", where),
        extra_info=_json_object(raw.get("extra_info"), "extra_info", where),
    )


def rows_to_table(rows: list[DataRow]) -> pa.Table:
    dicts = [r.to_dict() for r in rows]
    schema = ROW_SCHEMA.append(IMAGES_FIELD) if any("images" in d for d in dicts) else ROW_SCHEMA
    return pa.Table.from_pylist(dicts, schema=schema)


def write_rows(rows: list[DataRow], path: str | Path) -> Path:
    """The rows as one parquet file at ``path``, written beside it and moved into place (an existing
    file is replaced; a device, a FIFO or a folder there is refused, never replaced)."""
    path = Path(path)
    if path.exists() and not path.is_file():
        raise RowError(
            f"{path}: exists and is not a regular file (a folder, a device, a FIFO): give a file path"
        )
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
