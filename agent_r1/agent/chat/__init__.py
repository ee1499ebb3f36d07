"""Chat formats on token ids, message by message: ChatML with Hermes tool calls (Qwen), Llama 3
with JSON tool calls and ``ipython`` results, and gpt-oss's Harmony.

Every message is tokenised on its own. Special tokens split the text at message borders, so this
equals tokenising the whole rendered chat; and it lets the context keep an action's token ids
exactly as sampled instead of re-tokenising its text. A codec also owns its format's tool calls:
how a reply's calls are parsed, how tool results become the next observation's turn(s), and how a
demonstration written in Hermes form becomes the ids this format's model would sample.
``codec_for(tokenizer)`` picks the format by the tokenizer's special tokens. One module per
format: ``chatml`` (the base ``ChatCodec``), ``llama3``, ``harmony``.

Where a format's published template rewrites what the model sampled (Harmony turns a final
``<|return|>`` into ``<|end|>`` in later prompts), the codec keeps the sampled tokens: token in,
token out. The Jinja templates saved with the tiny models render exactly what the codecs encode.
"""

from agent_r1.agent.chat.chatml import (
    CHAT_FORMATS,
    IM_END,
    IM_START,
    VISION_TOKENS,
    ChatCodec,
    codec_for,
    content_text,
    render_message,
    render_system,
)

# the formats register in this order, the order codec_for tries them in
# isort: off
from agent_r1.agent.chat.llama3 import Llama3Codec
from agent_r1.agent.chat.harmony import HarmonyCodec
# isort: on

__all__ = [
    "CHAT_FORMATS",
    "IM_END",
    "IM_START",
    "VISION_TOKENS",
    "ChatCodec",
    "HarmonyCodec",
    "Llama3Codec",
    "codec_for",
    "content_text",
    "render_message",
    "render_system",
]
