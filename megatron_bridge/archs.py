"""What differs between the supported decoder-only architectures (everything else is shared:
RMSNorm, RoPE with rotate-half, SwiGLU MLP, GQA, optional tied embeddings)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ArchSpec:
    model_type: str
    qkv_bias: bool  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)


ARCHS = {
    "llama": ArchSpec("llama", qkv_bias=False, qk_norm=False),
    "qwen2": ArchSpec("qwen2", qkv_bias=True, qk_norm=False),
    "qwen3": ArchSpec("qwen3", qkv_bias=False, qk_norm=True),
}


def arch_for(hf_config: Any) -> ArchSpec:
    try:
        return ARCHS[hf_config.model_type]
    except KeyError:
        raise ValueError(
            f"model_type {hf_config.model_type!r} is not supported; supported: {sorted(ARCHS)}"
        ) from None
