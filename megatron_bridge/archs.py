"""What differs between the supported decoder-only architectures (everything else is shared:
RMSNorm, RoPE with rotate-half, SwiGLU MLP, GQA, optional tied embeddings).

A vision-language model (Qwen2-VL) is bridged through its language model: ``language_config``
gives its text config, whose checkpoint names are Qwen2's (``model.layers.*``); its rotary
positions are multimodal (three rows, ``mrope``). The vision tower is not a Megatron module."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ArchSpec:
    model_type: str
    qkv_bias: bool  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    mrope: bool = False  # multimodal rotary positions (time, height, width sections; Qwen2-VL)


ARCHS = {
    "llama": ArchSpec("llama", qkv_bias=False, qk_norm=False),
    "qwen2": ArchSpec("qwen2", qkv_bias=True, qk_norm=False),
    "qwen3": ArchSpec("qwen3", qkv_bias=False, qk_norm=True),
    "qwen2_vl_text": ArchSpec("qwen2_vl_text", qkv_bias=True, qk_norm=False, mrope=True),
    "qwen2_5_vl_text": ArchSpec("qwen2_5_vl_text", qkv_bias=True, qk_norm=False, mrope=True),
}
VISION_LANGUAGE = ("qwen2_vl", "qwen2_5_vl")  # model types whose language model is bridged (text_config)


def language_config(hf_config: Any) -> Any:
    """The config of the model's language model: its ``text_config`` for a vision-language model
    (which inherits the top level's ``tie_word_embeddings`` where it has none of its own)."""
    if hf_config.model_type not in VISION_LANGUAGE:
        return hf_config
    text = hf_config.text_config
    if getattr(text, "tie_word_embeddings", None) is None:
        text.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
    return text


def arch_for(hf_config: Any) -> ArchSpec:
    hf_config = language_config(hf_config)
    try:
        return ARCHS[hf_config.model_type]
    except KeyError:
        raise ValueError(
            f"model_type {hf_config.model_type!r} is not supported; supported: {sorted(ARCHS)}"
        ) from None
