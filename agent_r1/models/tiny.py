"""Tiny HF models for CPU tests and the quickstart: random init, a byte-level BPE tokenizer
trained on a recipe's text, and a chat template with tool markup — ChatML (default), Llama 3 or
Harmony (``chat_format``), the Jinja template rendering exactly what that format's codec encodes.
Saved as a normal HF folder (``config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from agent_r1.agent.chat import CHAT_FORMATS

ARCHS = ("qwen3", "qwen2", "llama")


def train_tokenizer(texts: list[str], vocab_size: int = 1024, chat_format: str = "chatml") -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fmt = CHAT_FORMATS[chat_format]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(fmt.SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    named = {fmt.EOS, fmt.PAD, fmt.BOS}
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=fmt.EOS,
        pad_token=fmt.PAD,
        bos_token=fmt.BOS,
        additional_special_tokens=[t for t in fmt.SPECIAL_TOKENS if t not in named],
        chat_template=fmt.JINJA,
        model_max_length=2048,
    )


def model_config(
    arch: str,
    vocab_size: int,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    max_positions: int,
    **ids: int,
) -> Any:
    import transformers as tf

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        **ids,
    )
    if arch == "qwen3":
        return tf.Qwen3Config(head_dim=hidden // heads, **common)
    if arch == "qwen2":
        return tf.Qwen2Config(**common)
    if arch == "llama":
        return tf.LlamaConfig(head_dim=hidden // heads, **common)
    raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")


def build_tiny_model(
    out: str | Path,
    texts: list[str],
    tools: list[dict[str, Any]] | None = None,
    arch: str = "qwen3",
    vocab_size: int = 1024,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    max_positions: int = 2048,
    seed: int = 0,
    chat_format: str = "chatml",
) -> Path:
    """Train the tokenizer on ``texts`` (plus chat/tool markup), build and save a random model."""
    from transformers import AutoModelForCausalLM

    if chat_format not in CHAT_FORMATS:
        raise ValueError(f"chat_format must be one of {sorted(CHAT_FORMATS)}, got {chat_format!r}")
    fmt = CHAT_FORMATS[chat_format]
    render = fmt.__new__(fmt)  # rendering needs no tokenizer
    chat = [render.render_prefix(None, tools), render.render_message("assistant", "ok")]
    out = Path(out)
    tokenizer = train_tokenizer(list(texts) + chat * 10, vocab_size, chat_format)
    ids = dict(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    cfg = model_config(arch, len(tokenizer), hidden, layers, heads, kv_heads, max_positions, **ids)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
