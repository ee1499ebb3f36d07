"""Policy (and critic) forward on packed streams: ``packed_forward`` runs Megatron's GPTModel over
one packed stream with block-diagonal causal attention and per-sequence positions (``PackedRotary``
lets the model take explicit per-token positions, restarting per packed sequence, on any layer
spec; Transformer Engine's spec takes THD ``PackedSeqParams`` instead)."""

from __future__ import annotations

from typing import Any

import torch

from agent_r1.learner import context_parallel
from agent_r1.learner.attention import AttentionPlan, install_packed_attention
from agent_r1.learner.backend.activation import install_fused_swiglu
from agent_r1.learner.backend.norm import install_fused_rms_norm
from agent_r1.learner.backend.rope import install_fused_rope
from agent_r1.learner.logprobs import install_output_rows
from agent_r1.learner.packing import Packed
from megatron_bridge.config import gpt_model


class PackedRotary(torch.nn.Module):
    """Drop-in for ``GPTModel.rotary_pos_emb``: RoPE angles at ``self.positions`` when set.
    Positions of three rows (3, N) are multimodal (Qwen2-VL's mRoPE): frequency i turns with row
    ``sections[i]`` (time, height or width)."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner
        self.positions: torch.Tensor | None = None
        self.sections: torch.Tensor | None = None  # (D/2,) row of each frequency, for mRoPE

    def get_rotary_seq_len(self, *args: Any, **kwargs: Any) -> int:
        return self.inner.get_rotary_seq_len(*args, **kwargs)

    def forward(
        self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group: Any = None
    ) -> torch.Tensor:
        if self.positions is None:
            return self.inner(max_seq_len, offset, packed_seq=packed_seq, cp_group=cp_group)
        inv = self.inner.inv_freq
        pos = self.positions
        if pos.dim() == 1:
            freqs = torch.outer(pos.to(inv.dtype), inv)
        else:
            if self.sections is None:
                raise ValueError("multimodal (3-row) positions need the model's mrope sections")
            rows = pos.to(inv.dtype)[self.sections.to(pos.device)]  # (D/2, N): each frequency's row
            freqs = rows.T * inv
        if getattr(self.inner, "rotary_interleaved", False):
            emb = torch.stack((freqs, freqs), dim=-1).view(freqs.shape[0], -1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb[:, None, None, :]


def install_packed_rotary(model: Any, sections: torch.Tensor | None = None) -> PackedRotary:
    """Swap the model's rotary embedding for a ``PackedRotary`` (idempotent; unwraps DDP etc.);
    ``sections``: the mRoPE row of each rotary frequency, for a multimodal model."""
    while not hasattr(model, "rotary_pos_emb") and hasattr(model, "module"):
        model = model.module
    if not isinstance(model.rotary_pos_emb, PackedRotary):
        model.rotary_pos_emb = PackedRotary(model.rotary_pos_emb)
    if sections is not None:
        model.rotary_pos_emb.sections = sections
    return model.rotary_pos_emb


def _uses_te(model: Any) -> bool:
    inner = gpt_model(model)
    layer = inner.decoder.layers[0] if hasattr(inner, "decoder") and len(inner.decoder.layers) else None
    return layer is not None and "TE" in type(layer.self_attention.core_attention).__name__


def packed_forward(
    model: Any, packed: Packed, rows: torch.Tensor | None = None, vision: Any = None, fused_plan: bool = False
) -> torch.Tensor:
    """GPTModel forward of one packed stream (batch 1): block-diagonal causal attention and
    per-sequence positions. Returns the last pipeline stage's output at stream positions ``rows``
    ((len(rows), V/tp) logits, or values for the critic), at every position when ``rows`` is
    None; hidden states for the next stage elsewhere.

    The micro-batch's tensors are already on the model's device. Local spec: causal attention per
    sequence (``PackedAttention``) and ``PackedRotary`` positions. Transformer Engine spec (GPU):
    THD ``PackedSeqParams`` with the sequence boundaries, which TE's attention and Megatron's RoPE
    understand natively (no N x N mask). The TE branch needs a GPU with Transformer Engine and is
    not exercised on the CPU test machines.

    Images (``packed.images``): on the first stage ``vision`` (a ``VisionEncoder``) embeds them and
    its rows replace the pads' token embeddings (``decoder_input``); positions are then 3-row
    (mRoPE) and take the local spec's ``PackedRotary``. ``fused_plan``: a dry run planning a GPU's
    fused kernels (``Backend.fused_plan``): the CPU kernels are not routed in, attention is planned
    fused."""

    out_rows = install_output_rows(model)  # also gathers a sequence-parallel stream's rows
    if out_rows is not None:
        out_rows["rows"] = rows
    try:
        out = _forward(model, packed, vision, fused_plan)
    finally:
        if out_rows is not None:
            out_rows["rows"] = None
    # last stage: (1, rows, V/tp) -> (rows, V/tp); other stages: hidden states for the next stage
    return out.squeeze(0) if gpt_model(model).post_process else out  # a view: indexing's backward copies


def _image_input(model: Any, packed: Packed, vision: Any) -> torch.Tensor | None:
    """The first stage's input embeddings with the image pads' rows from the vision tower."""
    if not packed.images:
        return None
    m = gpt_model(model)
    if not getattr(m, "pre_process", True):
        return None
    vision = vision if vision is not None else getattr(m, "vision_encoder", None)
    if vision is None:
        raise ValueError("the micro-batch has images but the learner has no vision tower")
    emb = m.embedding(input_ids=packed.tokens.unsqueeze(0), position_ids=None)  # (N, 1, hidden)
    feats = vision(packed.images).to(emb.dtype)
    if feats.shape[0] != packed.image_pos.numel():
        raise ValueError(f"{feats.shape[0]} image embeddings for {packed.image_pos.numel()} image pads")
    zero = torch.zeros_like(packed.image_pos)
    return emb.index_put((packed.image_pos, zero), feats)


def _forward(model: Any, packed: Packed, vision: Any = None, fused_plan: bool = False) -> torch.Tensor:
    multimodal = packed.positions.dim() == 2
    cfg = gpt_model(model).config
    if cfg.sequence_parallel and packed.num_tokens % cfg.tensor_model_parallel_size:
        raise ValueError(
            f"a packed stream of {packed.num_tokens} tokens does not split over "
            f"{cfg.tensor_model_parallel_size} sequence-parallel ranks: build the micro-batches with "
            "pad_to a multiple of parallel.tp (agent_r1.learner.optim.pad_multiple)"
        )
    if _uses_te(model) and multimodal:
        raise NotImplementedError(
            "multimodal (mRoPE) positions run on the local layer spec; the Transformer Engine spec "
            "applies its own 1-D rotary per packed sequence"
        )
    if _uses_te(model) and packed.parents is not None:
        raise NotImplementedError(
            "shared prefixes (optim.share_prefix) run on the local layer spec: Transformer Engine's "
            "packed attention has no branches"
        )
    if _uses_te(model):
        from megatron.core.packed_seq_params import PackedSeqParams

        if packed.cp is not None:  # TE's THD context parallelism: the rows in its partitioned layout
            cp = packed.cp
            params = PackedSeqParams(
                qkv_format="thd",
                cu_seqlens_q=cp.cu_real,
                cu_seqlens_kv=cp.cu_real,
                cu_seqlens_q_padded=cp.cu_padded,
                cu_seqlens_kv_padded=cp.cu_padded,
                max_seqlen_q=cp.max_padded,
                max_seqlen_kv=cp.max_padded,
            )
        else:
            cu = packed.cu_seqlens.to(torch.int32)
            longest = max(e - a for a, e in packed.bounds)
            params = PackedSeqParams(
                qkv_format="thd",
                cu_seqlens_q=cu,
                cu_seqlens_kv=cu,
                max_seqlen_q=longest,
                max_seqlen_kv=longest,
            )
        return model(
            packed.tokens.unsqueeze(0), packed.positions.unsqueeze(0), None, packed_seq_params=params
        )
    rotary = install_packed_rotary(model)
    attention = install_packed_attention(model)
    if not fused_plan:  # the CPU's native kernels (a GPU's plan keeps what its fused ones keep)
        install_fused_rms_norm(model)
        install_fused_swiglu(model)
        install_fused_rope(model)
    rotary.positions = packed.positions
    decoder_input = _image_input(model, packed, vision)
    positions = packed.positions[0] if multimodal else packed.positions  # (rope angles: PackedRotary)
    if attention is not None:
        if "attention" not in packed.cache:  # the same for every pass over this micro-batch
            if fused_plan:  # a dry run plans fused attention: no buckets, no masks
                plan = AttentionPlan([], packed.cp, fused=True)
            elif packed.cp is not None:  # every CP rank's keys, masked by place in the sequence
                plan = AttentionPlan([], packed.cp, context_parallel.attention_mask(packed.cp))
            else:
                plan = AttentionPlan.of(packed.bounds, packed.tokens.device, parents=packed.parents)
            packed.cache["attention"] = plan
        attention["plan"] = packed.cache["attention"]
    try:
        mask = None if attention is not None else packed.attention_mask()
        return model(packed.tokens.unsqueeze(0), positions.unsqueeze(0), mask, decoder_input=decoder_input)
    finally:
        rotary.positions = None
        if attention is not None:
            attention["plan"] = None
