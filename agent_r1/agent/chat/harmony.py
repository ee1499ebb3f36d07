"""gpt-oss's Harmony: channels, ``functions.NAME`` calls and results."""

from __future__ import annotations

import json
import re
from typing import Any

from agent_r1.agent.chat.chatml import DEFAULT_SYSTEM, ChatCodec, _hermes_calls
from agent_r1.agent.tool_calls import (
    MalformedCall,
    ToolCall,
)

HARMONY_JINJA = (
    "{%- set sys = (messages[0].content if messages and messages[0].role == 'system' else 'You are a helpful assistant.') -%}"
    "{{- '<|start|>system<|message|>' + sys + '<|end|>' -}}"
    "{%- if tools -%}"
    "{{- '<|start|>developer<|message|># Tools\\n\\n## functions\\n\\nnamespace functions {\\n' -}}"
    "{%- for t in tools -%}"
    "{{- '\\n// ' + t.function.description + '\\ntype ' + t.function.name + ' = (_: ' + (t.function.parameters | tojson) + ') => any;\\n' -}}"
    "{%- endfor -%}"
    "{{- '\\n} // namespace functions<|end|>' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'tool' -%}"
    "{{- '<|start|>functions.' + m.name + ' to=assistant<|channel|>commentary<|message|>' + m.content + '<|end|>' -}}"
    "{%- elif m.role == 'assistant' and m.tool_calls -%}"
    "{%- if m.content -%}{{- '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|return|>' -}}{%- endif -%}"
    "{%- for c in m.tool_calls -%}"
    "{{- '<|start|>assistant<|channel|>commentary to=functions.' + c.name + ' <|constrain|>json<|message|>' + (c.arguments | tojson) + '<|call|>' -}}"
    "{%- endfor -%}"
    "{%- elif m.role == 'assistant' -%}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|return|>' -}}"
    "{%- elif not (loop.first and m.role == 'system') -%}"
    "{{- '<|start|>' + m.role + '<|message|>' + m.content + '<|end|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start|>assistant' -}}{%- endif -%}"
)
_HARMONY_CALL = re.compile(
    r"to=functions\.([^\s<]+)[^<]*(?:<\|constrain\|>[^<]*)?<\|message\|>(.*?)(?:<\|call\|>|<\|end\|>|$)", re.S
)


class HarmonyCodec(ChatCodec):
    """gpt-oss's Harmony: ``<|start|>role<|channel|>...<|message|>content<|end|>``. The model
    writes after ``<|start|>assistant``: ``<|channel|>final<|message|>answer<|return|>`` or a call
    ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{args}<|call|>`` (one
    per reply; analysis messages may come first). Results come back as ``functions.NAME`` messages;
    the tool schemas are a ``developer`` message. A sampled ``<|return|>`` stays in the history
    (gpt-oss's own template rewrites it to ``<|end|>``; here the sampled tokens are kept)."""

    FORMAT = "harmony"
    MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|call|>", "<|return|>")
    SPECIAL_TOKENS = ("<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                      "<|constrain|>", "<|return|>", "<|call|>")  # fmt: skip
    EOS, PAD, BOS = "<|return|>", "<|endoftext|>", None
    JINJA = HARMONY_JINJA
    END = "<|return|>"
    EXTRA_STOPS = ("<|call|>", "<|endoftext|>")

    def generation_prompt(self) -> str:
        return "<|start|>assistant"

    def turn_end(self) -> str:
        return ""

    def render_message(self, role: str, content: str) -> str:
        if role == "assistant":
            return f"<|start|>assistant<|channel|>final<|message|>{content}<|return|>"
        return f"<|start|>{role}<|message|>{content}<|end|>"

    def render_prefix(self, system: str | None, tools: list[dict[str, Any]] | None) -> str:
        text = f"<|start|>system<|message|>{system if system is not None else DEFAULT_SYSTEM}<|end|>"
        if tools:
            decls = "".join(
                f"\n// {t['function'].get('description', '')}\ntype {t['function']['name']} = "
                f"(_: {json.dumps(t['function'].get('parameters', {}), ensure_ascii=False)}) => any;\n"
                for t in tools
            )
            text += f"<|start|>developer<|message|># Tools\n\n## functions\n\nnamespace functions {{\n{decls}\n}} // namespace functions<|end|>"
        return text

    def format_tool_call(self, name: str, arguments: dict[str, Any]) -> str:
        args = json.dumps(arguments, ensure_ascii=False)
        return f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{args}"

    def render_assistant(self, content: str, calls: list[tuple[str, dict[str, Any]]]) -> str:
        text = self.render_message("assistant", content) if content else ""
        return text + "".join(f"<|start|>assistant{self.format_tool_call(n, a)}<|call|>" for n, a in calls)

    def render_tool_results(self, results: list[tuple[str | None, str]]) -> str:
        return "".join(
            f"<|start|>functions.{name or 'unknown'} to=assistant<|channel|>commentary<|message|>{r}<|end|>"
            for name, r in results
        )

    def feedback_text(self, results: list[tuple[str | None, str]]) -> str:
        return "\n".join(r for _, r in results)

    def parse_tool_calls(self, text: str) -> list[ToolCall | MalformedCall]:
        out: list[ToolCall | MalformedCall] = []
        for m in _HARMONY_CALL.finditer(text):
            name, raw = m.group(1), m.group(2).strip()
            try:
                args = json.loads(raw) if raw else {}
            except json.JSONDecodeError as e:
                out.append(
                    MalformedCall(m.group(0), f"invalid JSON in tool call: {e.msg} at position {e.pos}")
                )
                continue
            if not isinstance(args, dict):
                out.append(
                    MalformedCall(m.group(0), f"arguments must be a JSON object, got {type(args).__name__}")
                )
                continue
            out.append(ToolCall(name, args))
        if not out and "to=" in text:
            return [MalformedCall(text, "a recipient other than functions.NAME, or no <|message|> after it")]
        return out

    def content(self, text: str, final: bool = True) -> str:
        key = "<|channel|>final<|message|>"
        cut = text.rfind(key)
        return text[cut + len(key) :] if cut >= 0 else ""

    def answer_text(self, text: str) -> str:
        return self.content(text) if "<|channel|>" in text else text

    def encode_action(self, text: str) -> list[int]:
        content, calls = _hermes_calls(text)
        if len(calls) > 1:
            raise ValueError("harmony: one tool call per reply (the model stops at <|call|>)")
        if calls:
            return self.encode(self.format_tool_call(*calls[0])) + [self.tokenizer.get_vocab()["<|call|>"]]
        return self.encode(f"<|channel|>final<|message|>{content}") + [self.end_id]
