"""Hermes tool-call format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

Parsing never raises: each block becomes a ``ToolCall`` or a ``MalformedCall`` whose message says
what was wrong, so the environment can answer with error feedback instead of crashing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
RESP_OPEN, RESP_CLOSE = "<tool_response>", "</tool_response>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class MalformedCall:
    raw: str
    error: str


def parse_tool_calls(text: str) -> list[ToolCall | MalformedCall]:
    """All tool-call blocks in ``text``, in order. Text outside the blocks is ignored."""
    out: list[ToolCall | MalformedCall] = []
    pos = 0
    while True:
        start = text.find(OPEN, pos)
        if start < 0:
            return out
        body_start = start + len(OPEN)
        end = text.find(CLOSE, body_start)
        if end < 0:
            out.append(MalformedCall(text[start:], f"unclosed {OPEN} (missing {CLOSE})"))
            return out
        out.append(_parse_one(text[body_start:end]))
        pos = end + len(CLOSE)


def _parse_one(raw: str) -> ToolCall | MalformedCall:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return MalformedCall(raw, f"invalid JSON in tool call: {e.msg} at position {e.pos}")
    if not isinstance(obj, dict):
        return MalformedCall(raw, f"tool call must be a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return MalformedCall(raw, 'tool call needs a string "name"')
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models emit the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return MalformedCall(raw, f'"arguments" is a string that is not JSON: {e.msg}')
    if not isinstance(args, dict):
        return MalformedCall(raw, f'"arguments" must be a JSON object, got {type(args).__name__}')
    extra = set(obj) - {"name", "arguments"}
    if extra:
        return MalformedCall(raw, f"unexpected keys in tool call: {sorted(extra)}")
    return ToolCall(name, args)


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CLOSE}"


def format_tool_responses(results: list[str]) -> str:
    """One user turn holding every result, in call order (Qwen/Hermes convention)."""
    return "\n".join(f"{RESP_OPEN}\n{r}\n{RESP_CLOSE}" for r in results)
