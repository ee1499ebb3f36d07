"""Llama 3.x: JSON tool calls, ``ipython`` results."""

from __future__ import annotations

import json
from typing import Any

from agent_r1.agent.chat.chatml import DEFAULT_SYSTEM, ChatCodec, _hermes_calls, _json_call
from agent_r1.agent.tool_calls import (
    MalformedCall,
    ToolCall,
)

LLAMA3_JINJA = (
    "{{- '<|begin_of_text|>' -}}"
    "{%- set sys = (messages[0].content if messages and messages[0].role == 'system' else 'You are a helpful assistant.') -%}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + sys -}}"
    "{%- if tools -%}"
    "{{- '\\n\\nYou have access to the following functions. To call one, reply with only a JSON object "
    '{"name": function name, "parameters": {argument: value}}.\\n\' -}}'
    "{%- for t in tools -%}{{- '\\n' + (t | tojson) -}}{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|eot_id|>' -}}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'tool' -%}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' -}}"
    "{%- elif m.role == 'assistant' and m.tool_calls -%}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}"
    "{%- for c in m.tool_calls -%}{%- if not loop.first -%}{{- '; ' -}}{%- endif -%}"
    "{{- '{\"name\": \"' + c.name + '\", \"parameters\": ' + (c.arguments | tojson) + '}' -}}"
    "{%- endfor -%}"
    "{{- '<|eot_id|>' -}}"
    "{%- elif not (loop.first and m.role == 'system') -%}"
    "{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
)


class Llama3Codec(ChatCodec):
    """Llama 3.x: ``<|start_header_id|>role<|end_header_id|>\\n\\ncontent<|eot_id|>``; a tool call is
    the whole reply as ``{"name", "parameters"}`` JSON (several: joined by ``; ``); results come back
    as ``ipython`` turns, one per call. The tool schemas go in the system prompt."""

    FORMAT = "llama3"
    MARKERS = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
    SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                      "<|eot_id|>", "<|eom_id|>", "<|python_tag|>")  # fmt: skip
    EOS, PAD, BOS = "<|eot_id|>", "<|end_of_text|>", "<|begin_of_text|>"
    JINJA = LLAMA3_JINJA
    END = "<|eot_id|>"
    EXTRA_STOPS = ("<|eom_id|>", "<|end_of_text|>")

    def generation_prompt(self) -> str:
        return "<|start_header_id|>assistant<|end_header_id|>\n\n"

    def turn_end(self) -> str:
        return ""

    def render_message(self, role: str, content: str) -> str:
        return f"<|start_header_id|>{role}<|end_header_id|>\n\n{content}<|eot_id|>"

    def render_prefix(self, system: str | None, tools: list[dict[str, Any]] | None) -> str:
        text = system if system is not None else DEFAULT_SYSTEM
        if tools:
            text += (
                "\n\nYou have access to the following functions. To call one, reply with only a JSON "
                'object {"name": function name, "parameters": {argument: value}}.\n'
            )
            text += "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
        return "<|begin_of_text|>" + self.render_message("system", text)

    def format_tool_call(self, name: str, arguments: dict[str, Any]) -> str:
        return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)

    def render_assistant(self, content: str, calls: list[tuple[str, dict[str, Any]]]) -> str:
        return self.render_message("assistant", "; ".join(self.format_tool_call(n, a) for n, a in calls))

    def render_tool_results(self, results: list[tuple[str | None, str]]) -> str:
        return "".join(self.render_message("ipython", r) for _, r in results)

    def feedback_text(self, results: list[tuple[str | None, str]]) -> str:
        return "\n".join(r for _, r in results)

    def parse_tool_calls(self, text: str) -> list[ToolCall | MalformedCall]:
        s = text.strip()
        if not s.startswith("{"):
            return []
        return [_json_call(part, ("parameters", "arguments")) for part in _split_calls(s)]

    def content(self, text: str, final: bool = True) -> str:
        return "" if text.lstrip().startswith("{") else text

    def encode_action(self, text: str) -> list[int]:
        content, calls = _hermes_calls(text)
        if calls:
            return self.encode("; ".join(self.format_tool_call(n, a) for n, a in calls)) + [self.end_id]
        return self.encode(content) + [self.end_id]


def _split_calls(s: str) -> list[str]:
    """``{...}; {...}`` -> the JSON objects (semicolons inside strings are kept)."""
    parts, depth, start, in_str, esc = [], 0, 0, False, False
    for i, ch in enumerate(s):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
            continue
        if ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == ";" and depth == 0:
            parts.append(s[start:i].strip())
            start = i + 1
    parts.append(s[start:].strip())
    return [p for p in parts if p]
