"""What differs between the supported decoder-only architectures (everything else is shared:
RMSNorm, RoPE with rotate-half, SwiGLU MLP, GQA, optional tied embeddings).

A mixture-of-experts model (Qwen3-MoE) replaces every layer's MLP by a top-k softmax router over
SwiGLU experts (``moe_config``); its checkpoint names each expert's projections
(``mlp.experts.{e}.gate_proj``) and the router (``mlp.gate``).

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
    moe: bool = False  # routed experts in place of the MLP (Qwen3-MoE)


ARCHS = {
    "llama": ArchSpec("llama", qkv_bias=False, qk_norm=False),
    "qwen2": ArchSpec("qwen2", qkv_bias=True, qk_norm=False),
    "qwen3": ArchSpec("qwen3", qkv_bias=False, qk_norm=True),
    "qwen3_moe": ArchSpec("qwen3_moe", qkv_bias=False, qk_norm=True, moe=True),
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


@dataclass(frozen=True)
class MoEConfig:
    experts: int
    topk: int
    ffn: int  # each expert's intermediate size
    norm_topk: bool  # the top-k probabilities renormalised to sum to 1
    aux_loss_coef: float  # the router's load-balancing loss (Switch-style), as HF computes it


def moe_config(hf_config: Any) -> MoEConfig | None:
    """The routed-experts part of an MoE model's config (None for a dense model); refuses a model
    whose layers are not all sparse (``decoder_sparse_step`` > 1 or ``mlp_only_layers``)."""
    hf_config = language_config(hf_config)
    if not arch_for(hf_config).moe:
        return None
    experts = getattr(hf_config, "num_experts", None) or hf_config.num_local_experts
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    dense = list(getattr(hf_config, "mlp_only_layers", None) or [])
    if step != 1 or dense:
        raise ValueError(
            f"{hf_config.model_type}: every layer must be sparse (decoder_sparse_step=1, mlp_only_layers=[]); "
            f"got decoder_sparse_step={step}, mlp_only_layers={dense}"
        )
    return MoEConfig(
        experts=int(experts),
        topk=int(hf_config.num_experts_per_tok),
        ffn=int(hf_config.moe_intermediate_size),
        norm_topk=bool(getattr(hf_config, "norm_topk_prob", True)),
        aux_loss_coef=float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0),
    )
