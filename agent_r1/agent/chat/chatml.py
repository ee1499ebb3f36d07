"""ChatML with Hermes tool calls (Qwen2.5 / Qwen3): ``ChatCodec``, the base every format's codec
derives from, the registry of formats (``CHAT_FORMATS``) and ``codec_for``."""

from __future__ import annotations

import functools
import json
from typing import Any

from agent_r1.agent.tool_calls import OPEN as CALL_OPEN
from agent_r1.agent.tool_calls import (
    MalformedCall,
    ToolCall,
    format_tool_call,
    format_tool_responses,
    parse_tool_calls,
)
from agent_r1.vision.images import Image, ImageError, VisionSpec, load_image, pad_runs, part_image

# every chat format, by name, in detection order (a codec class registers itself when defined)
CHAT_FORMATS: dict[str, type[ChatCodec]] = {}

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, "<|video_pad|>")  # the Qwen2-VL family's

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
# A message's content is a string or a list of parts (text / image); an image renders as the
# Qwen2-VL markup with one pad, which the HF processor expands to the image's token count.
CONTENT_JINJA = (
    "{%- macro content(c) -%}{%- if c is string -%}{{- c -}}{%- else -%}{%- for p in c -%}"
    "{%- if p.type == 'image' or p.type == 'image_url' or 'image' in p or 'image_url' in p -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif 'text' in p -%}{{- p.text -}}{%- endif -%}{%- endfor -%}{%- endif -%}{%- endmacro -%}"
)
CHATML_JINJA = CONTENT_JINJA + (
    "{%- set sys = (content(messages[0].content) if messages and messages[0].role == 'system' else 'You are a helpful assistant.') -%}"
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
    "{%- if m.role == 'tool' -%}"
    "{%- if loop.previtem is not defined or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user\\n' -}}"
    "{%- else -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_response>\\n' + content(m.content) + '\\n</tool_response>' -}}"
    "{%- if loop.nextitem is not defined or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- elif m.role == 'assistant' and m.tool_calls -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if m.content -%}{{- content(m.content) + '\\n' -}}{%- endif -%}"
    "{%- for c in m.tool_calls -%}{%- if not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": \"' + c.name + '\", \"arguments\": ' + (c.arguments | tojson) + '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif not (loop.first and m.role == 'system') -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + content(m.content) + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


class ChatCodec:
    """ChatML (``<|im_start|>role\\ncontent<|im_end|>\\n``) with Hermes tool calls: Qwen2.5 / Qwen3."""

    FORMAT = "chatml"
    MARKERS: tuple[str, ...] = (IM_START, IM_END)  # special tokens that identify the format
    # for building tiny models of this format: its special tokens, their roles, its Jinja template
    SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", IM_START, IM_END, "<tool_call>", "</tool_call>",
                                       "<tool_response>", "</tool_response>")  # fmt: skip
    EOS, PAD, BOS = IM_END, "<|endoftext|>", None
    JINJA = CHATML_JINJA
    END = IM_END  # the token that ends a reply the model samples
    EXTRA_STOPS: tuple[str, ...] = ()
    vision: VisionSpec | None = None  # a vision model's image geometry (``load`` reads it)

    def __init_subclass__(cls, **kw: Any) -> None:  # a format's module registers it by defining it
        super().__init_subclass__(**kw)
        CHAT_FORMATS[cls.FORMAT] = cls

    @staticmethod
    @functools.lru_cache(maxsize=8)
    def load(path: str) -> ChatCodec:
        """The codec of the HF folder ``path``, its format detected (cached: environments built
        per episode share it)."""
        from transformers import AutoTokenizer

        codec = codec_for(AutoTokenizer.from_pretrained(path))
        if VISION_START in codec.tokenizer.get_vocab():  # a vision model's folder: its image geometry
            codec.vision = VisionSpec.from_folder(path)
        return codec

    @classmethod
    def detect(cls, vocab: dict[str, int]) -> bool:
        return all(t in vocab for t in cls.MARKERS)

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab()
        missing = [t for t in self.MARKERS if t not in vocab]
        if missing:
            raise ValueError(f"tokenizer has no {missing[0]!r} token; the {self.FORMAT} codec needs it")
        self.end_id = vocab[self.END]
        self.im_end_id = self.end_id  # the name ChatML gives it
        self.generation_prompt_ids = self.encode(self.generation_prompt())
        self.turn_end_ids = self.encode(self.turn_end())
        eos = tokenizer.eos_token_id
        stops = {self.end_id} | {vocab[t] for t in self.EXTRA_STOPS if t in vocab}
        self.stop_token_ids = sorted(stops | ({eos} if eos is not None else set()))

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token can stand for: its vocabulary string's length (byte-level
        BPE spells each byte as one character, and a text character is at least one byte)."""
        return max(len(t) for t in self.tokenizer.get_vocab())

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def decode_action(self, ids: list[int]) -> str:
        """Text of an action without its trailing stop token."""
        if ids and ids[-1] in self.stop_token_ids:
            ids = ids[:-1]
        return self.decode(ids)

    # ---- rendering (text); each format overrides these ----------------------------------------
    def generation_prompt(self) -> str:
        return f"{IM_START}assistant\n"

    def turn_end(self) -> str:
        return "\n"  # after the stop token that closed an assistant turn

    def render_message(self, role: str, content: str) -> str:
        return render_message(role, content)

    def render_prefix(self, system: str | None, tools: list[dict[str, Any]] | None) -> str:
        """The protected prefix: system prompt and tool schemas."""
        return render_message("system", render_system(system, tools))

    def format_tool_call(self, name: str, arguments: dict[str, Any]) -> str:
        """A call as the model writes it (the reply's text, stop token excluded)."""
        return format_tool_call(name, arguments)

    def render_assistant(self, content: str, calls: list[tuple[str, dict[str, Any]]]) -> str:
        """A past assistant message with tool calls, as the next prompt shows it."""
        text = "\n".join(([content] if content else []) + [self.format_tool_call(n, a) for n, a in calls])
        return self.render_message("assistant", text)

    def render_tool_results(self, results: list[tuple[str | None, str]]) -> str:
        """One step's tool results (tool name, result text) as the turn(s) of the next prompt."""
        return self.render_message("user", format_tool_responses([r for _, r in results]))

    def parse_tool_calls(self, text: str) -> list[ToolCall | MalformedCall]:
        return parse_tool_calls(text)

    def content(self, text: str, final: bool = True) -> str:
        """What a user sees of a reply (or of a reply still streaming): the text before any tool
        call, without a partial call marker at the end while it streams."""
        cut = text.find(CALL_OPEN)
        if cut >= 0:
            return text[:cut]
        return text if final else _drop_partial(text, CALL_OPEN)

    def answer_text(self, text: str) -> str:
        """A reply without the format's own markup (Harmony: its final channel), tools aside."""
        return text

    # ---- token ids -----------------------------------------------------------------------------
    def encode_message(self, role: str, content: str) -> list[int]:
        return self.encode(self.render_message(role, content))

    def encode_system(self, system: str | None, tools: list[dict[str, Any]] | None) -> list[int]:
        return self.encode(self.render_prefix(system, tools))

    def encode_tool_results(self, results: list[tuple[str | None, str]]) -> tuple[list[int], str]:
        """The ids of one step's tool-result turn(s) and their readable text (a record's
        ``feedback``)."""
        return self.encode(self.render_tool_results(results)), self.feedback_text(results)

    def feedback_text(self, results: list[tuple[str | None, str]]) -> str:
        return format_tool_responses([r for _, r in results])

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """``messages``: system / user / assistant (``content``, optional ``tool_calls`` as
        ``[{"name", "arguments"}]``) / tool (``name``, ``content``; consecutive ones are one step's
        results). Text only: messages with images go through ``encode_chat_images``."""
        ids, images = self.encode_chat_images(messages, tools, add_generation_prompt)
        if images:
            raise ImageError(
                f"the messages carry {len(images)} image(s): encode them with encode_chat_images, "
                "which returns the images with the ids"
            )
        return ids

    def encode_chat_images(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> tuple[list[int], list[Image]]:
        """``encode_chat`` where a content may be a list of text and image parts: the ids (each
        image as its vision markup, pads expanded) and the images in the order they appear."""
        images: list[Image] = []
        system = None
        if messages and messages[0]["role"] == "system":
            system = self.render_content(messages[0].get("content") or "", images, "message 0")
            messages = messages[1:]
        text = self.render_prefix(system, tools)
        # message numbers in errors count the system one
        text += self.render_turns(messages, images, first=1 if system is not None else 0)
        ids = self.encode(text) + (self.generation_prompt_ids if add_generation_prompt else [])
        return ids, images

    def render_turns(self, messages: list[dict[str, Any]], images: list[Image], first: int = 0) -> str:
        """The turns of ``messages`` (no system message) as text, images appended to ``images``;
        consecutive tool messages are one step's results. ``first``: the number of the first
        message in errors."""
        text = ""
        results: list[tuple[str | None, str]] = []
        for i, m in enumerate(messages, first):
            body = self.render_content(m.get("content") or "", images, f"message {i}")
            if m["role"] == "tool":
                results.append((m.get("name"), body))
                continue
            if results:
                text += self.render_tool_results(results)
                results = []
            if m["role"] == "assistant" and m.get("tool_calls"):
                text += self.render_assistant(body, [(c["name"], c["arguments"]) for c in m["tool_calls"]])
            else:
                text += self.render_message(m["role"], body)
        if results:
            text += self.render_tool_results(results)
        return text

    def encode_turns(self, messages: list[dict[str, Any]], first: int = 0) -> tuple[list[int], list[Image]]:
        """``render_turns`` as token ids (the turns a conversation gained since its last reply),
        with their images."""
        images: list[Image] = []
        return self.encode(self.render_turns(messages, images, first)), images

    # ---- images (Qwen2-VL family) ----------------------------------------------------------------
    def render_content(self, content: str | list[dict[str, Any]], images: list[Image], where: str) -> str:
        """A message's content as text: text parts as they are, each image part as its vision markup
        (appended to ``images``)."""
        if isinstance(content, str):
            return content
        if not isinstance(content, list):
            raise ValueError(
                f"{where}: content must be a string or a list of parts, got {type(content).__name__}"
            )
        out = []
        for j, part in enumerate(content):
            if not isinstance(part, dict):
                raise ValueError(f"{where}, part {j}: expected an object, got {type(part).__name__}")
            src = part_image(part)
            if src is None:
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"{where}, part {j}: neither a text nor an image part: {sorted(part)}")
                out.append(part["text"])
                continue
            image = load_image(src, f"{where}, part {j}")
            out.append(self.image_markup(image))
            images.append(image)
            if len(images) > self.vision_spec(where).max_images:
                raise ImageError(
                    f"{where}: more than {self.vision_spec(where).max_images} images in one prompt "
                    "(the model's limit: preprocessor_config.json agent_r1_max_images)"
                )
        return "".join(out)

    def encode_message_images(
        self, role: str, content: Any, where: str = "message"
    ) -> tuple[list[int], list[Image]]:
        """One message whose content may hold images: its ids and its images in order."""
        images: list[Image] = []
        return self.encode_message(role, self.render_content(content, images, where)), images

    def vision_spec(self, where: str = "prompt") -> VisionSpec:
        if self.vision is None:
            raise ImageError(
                f"{where}: an image was sent to a text-only model (its folder has no "
                "preprocessor_config.json or its tokenizer no <|image_pad|> token)"
            )
        return self.vision

    def image_markup(self, image: Image) -> str:
        n = self.vision_spec().num_tokens(image)
        return VISION_START + IMAGE_PAD * n + VISION_END

    def image_token_id(self) -> int:
        return self.tokenizer.convert_tokens_to_ids(IMAGE_PAD)

    @functools.cached_property
    def vision_token_ids(self) -> frozenset[int]:
        """The vision markup's ids when this is a vision model (a sampled one cannot be shown
        again: it would read as an image); empty for a text model."""
        if self.vision is None:
            return frozenset()
        vocab = self.tokenizer.get_vocab()
        return frozenset(vocab[t] for t in VISION_TOKENS if t in vocab)

    def image_pad_runs(self, ids: list[int]) -> list[int]:
        """The lengths of the ``<|image_pad|>`` runs in ``ids``, in order (none for a text model)."""
        pad = self.tokenizer.get_vocab().get(IMAGE_PAD)
        return [] if pad is None else [b - a for a, b in pad_runs(ids, pad)]

    def check_image_pads(self, ids: list[int], images: list[Image], where: str = "observation") -> None:
        """Raise ImageError unless ``ids`` hold one pad run per image, each of that image's size."""
        runs = self.image_pad_runs(ids)
        if not images and not runs:
            return
        spec = self.vision_spec(where)
        want = [spec.num_tokens(im) for im in images]
        if runs != want:
            raise ImageError(
                f"{where}: its <|image_pad|> runs {runs} do not match its {len(images)} image(s), "
                f"which take {want} tokens"
            )

    def close_action(self, action_ids: list[int]) -> list[int]:
        """Tokens that end an assistant turn after the sampled ids: the end token only when the
        action lacks it (truncated), then the format's separator. They go into the *next
        observation*, so the policy is never trained on them."""
        closing = [] if action_ids and action_ids[-1] in self.stop_token_ids else [self.end_id]
        return closing + self.turn_end_ids

    def encode_action(self, text: str) -> list[int]:
        """The ids this format's model samples for a reply written in Hermes form (demonstrations,
        scripted policies): its calls re-rendered in this format, then the stop token."""
        return self.encode(text) + [self.end_id]


def content_text(content: Any) -> str:
    """A message content's text (an image part shows as ``[image]``): for summaries and logs."""
    if isinstance(content, str):
        return content
    return "".join("[image]" if part_image(p) is not None else p.get("text", "") for p in content)


def _drop_partial(text: str, marker: str) -> str:
    """``text`` without a tail that could be the start of ``marker`` (a tag still streaming)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return text[:-k]
    return text


def _hermes_calls(text: str) -> tuple[str, list[tuple[str, dict[str, Any]]]]:
    """A Hermes-form reply as (text before the calls, calls); a malformed block is an error."""
    calls = parse_tool_calls(text)
    bad = [c for c in calls if isinstance(c, MalformedCall)]
    if bad:
        raise ValueError(f"demonstration reply has a malformed tool call: {bad[0].error}")
    cut = text.find(CALL_OPEN)
    return (text if cut < 0 else text[:cut]).strip(), [(c.name, c.arguments) for c in calls]


def _json_call(raw: str, arg_keys: tuple[str, ...]) -> ToolCall | MalformedCall:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return MalformedCall(raw, f"invalid JSON in tool call: {e.msg} at position {e.pos}")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return MalformedCall(raw, 'tool call needs a string "name"')
    args = next((obj[k] for k in arg_keys if k in obj), {})
    if not isinstance(args, dict):
        return MalformedCall(raw, f'"{arg_keys[0]}" must be a JSON object, got {type(args).__name__}')
    return ToolCall(obj["name"], args)


CHAT_FORMATS["chatml"] = ChatCodec  # first: detection tries the formats in this order


def codec_for(tokenizer: Any) -> ChatCodec:
    """The codec of ``tokenizer``'s chat format, told by its special tokens."""
    vocab = tokenizer.get_vocab()
    for cls in CHAT_FORMATS.values():
        if cls.detect(vocab):
            return cls(tokenizer)
    raise ValueError(
        "the tokenizer's chat format is none agent-r1 knows: ChatML (<|im_start|>), Llama 3 "
        "(<|start_header_id|>) or Harmony (<|start|> <|channel|>)"
    )
