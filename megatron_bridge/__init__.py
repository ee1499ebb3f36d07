"""HF <-> Megatron-Core bridge for Llama (SmolLM2), Qwen2, Qwen3 and Qwen2-VL's language model
(our own, small).

``archs.py`` holds one ``ArchSpec`` per architecture (what differs: q/k/v bias, q/k norm);
``config.py`` maps an HF config to a Megatron ``TransformerConfig`` + GPTModel arguments + layer
spec (Transformer Engine spec when TE imports, local spec otherwise); ``weights.py`` shards HF
tensors into any TP/PP/EP layout (and virtual pipeline stages) (fused QKV with GQA grouping, fused gate/up, tied embeddings,
padded vocabulary) and exports Megatron weights back to HF names.
"""

from megatron_bridge.archs import ARCHS, ArchSpec, arch_for, language_config
from megatron_bridge.config import BridgeConfig, build_gpt_chunks, build_gpt_model, megatron_config
from megatron_bridge.weights import export_hf_weights, load_hf_weights

__all__ = [
    "ARCHS",
    "ArchSpec",
    "BridgeConfig",
    "arch_for",
    "language_config",
    "build_gpt_chunks",
    "build_gpt_model",
    "export_hf_weights",
    "load_hf_weights",
    "megatron_config",
]
