"""ChatML templating on token ids, message by message.

Every message is tokenised on its own (``<|im_start|>role\\ncontent<|im_end|>\\n``). Special tokens
split the text at message borders, so this equals tokenising the whole rendered chat; and it lets
the context keep an action's token ids exactly as sampled instead of re-tokenising its text.
The tool-schema system prompt follows the Qwen2.5/Hermes convention.
"""

from __future__ import annotations

import functools
import json
from typing import Any

IM_START, IM_END = "<|im_start|>", "<|im_end|>"

TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
DEFAULT_SYSTEM = "You are a helpful assistant."


def render_system(system: str | None, tools: list[dict[str, Any]] | None) -> str:
    """Content of the system message: the system text, then the tool schemas if any."""
    system = system if system is not None else DEFAULT_SYSTEM
    if not tools:
        return system
    schemas = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
    return f"{system}\n\n{TOOLS_PREAMBLE}{schemas}{TOOLS_POSTAMBLE}"


def render_message(role: str, content: str) -> str:
    return f"{IM_START}{role}\n{content}{IM_END}\n"


# The same template as Jinja, saved into tokenizer_config.json of the models we build so that
# ``tokenizer.apply_chat_template`` (HF, SGLang) renders exactly what ChatCodec encodes.
CHATML_JINJA = (
    "{%- set sys = (messages[0].content if messages and messages[0].role == 'system' else 'You are a helpful assistant.') -%}"
    "{{- '<|im_start|>system\\n' + sys -}}"
    "{%- if tools -%}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}"
    "{%- for t in tools -%}{{- '\\n' + (t | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, '
    '"arguments": <args-json-object>}\\n</tool_call>\' -}}'
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- for m in messages -%}"
    "{%- if not (loop.first and m.role == 'system') -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


class ChatCodec:
    """Turns chat messages into token ids (and actions back into text) for a ChatML tokenizer."""

    @classmethod
    @functools.lru_cache(maxsize=8)
    def load(cls, path: str) -> ChatCodec:
        """The codec of the HF folder ``path`` (cached: environments built per episode share it)."""
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(path))

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab()
        for tok in (IM_START, IM_END):
            if tok not in vocab:
                raise ValueError(f"tokenizer has no {tok!r} token; ChatCodec needs a ChatML tokenizer")
        self.im_end_id = vocab[IM_END]
        self.generation_prompt_ids = self.encode(f"{IM_START}assistant\n")
        self.turn_end_ids = self.encode("\n")  # after <|im_end|> closing an assistant turn
        eos = tokenizer.eos_token_id
        self.stop_token_ids = sorted({self.im_end_id} | ({eos} if eos is not None else set()))

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def decode_action(self, ids: list[int]) -> str:
        """Text of an action without its trailing stop token."""
        if ids and ids[-1] in self.stop_token_ids:
            ids = ids[:-1]
        return self.decode(ids)

    def encode_message(self, role: str, content: str) -> list[int]:
        return self.encode(render_message(role, content))

    def encode_system(self, system: str | None, tools: list[dict[str, Any]] | None) -> list[int]:
        return self.encode_message("system", render_system(system, tools))

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        system = None
        if messages and messages[0]["role"] == "system":
            system, messages = messages[0]["content"], messages[1:]
        ids = self.encode_system(system, tools)
        for m in messages:
            ids += self.encode_message(m["role"], m["content"])
        return ids + (self.generation_prompt_ids if add_generation_prompt else [])

    def close_action(self, action_ids: list[int]) -> list[int]:
        """Tokens that end an assistant turn after the sampled ids: ``<|im_end|>`` only when the
        action lacks it (truncated), then the newline. They go into the *next observation*, so the
        policy is never trained on them."""
        closing = [] if action_ids and action_ids[-1] in self.stop_token_ids else [self.im_end_id]
        return closing + self.turn_end_ids
