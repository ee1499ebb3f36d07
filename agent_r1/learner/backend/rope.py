"""The rotary embedding of a CPU learner's queries and keys, forward and backward in one native pass.

Without Transformer Engine Megatron applies RoPE unfused (``_apply_rotary_pos_emb_bshd``): per
layer, for q and for k, cos and sin of the angles, chunk, neg, cat, two muls, an add and a cat with
the pass-through part, forward and backward -- ~250 small ops an update at SmolLM2's 30 layers.
``install_fused_rope`` sets ``apply_rope_fusion`` on each self-attention's own copy of the config
and gives Megatron's ``fused_apply_rotary_pos_emb`` hook (empty without TE) ``fused_rope``:
``native/rope.cpp`` with Megatron's cos_ and sin_ (computed once per forward, every layer shares
the angles), the products and sum rounded as PyTorch's ops round them, so the values are
Megatron's unfused ones.
"""

from __future__ import annotations

import copy
import functools
import weakref
from typing import Any

import torch

from agent_r1 import native


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fn: Any) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.fn = fn
        return _run(fn, t.contiguous(), cos, sin, 1.0)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _run(ctx.fn, dy.contiguous(), cos, sin, -1.0), None, None, None


def _run(fn: Any, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    y = torch.empty_like(t)
    if fn is not _META:
        S, D, R = t.shape[0], t.shape[-1], cos.shape[-1]
        native.call(fn, t, cos, sin, y, S, t.numel() // (S * D), D, R, sign)
    return y


_META = native.META[0]  # a dry run of a CPU learner


@functools.cache
def _kernel(dtype: torch.dtype) -> Any:
    return native.function("rope", "agent_r1_rope", dtype, "p p p p i32 i32 i32 i32 f32")


_ANGLES: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(freqs) -> its cos_, sin_ while freqs lives


def _cos_sin(freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's cos_ and sin_ of ``freqs``, computed once for all the layers of a forward (they
    share the angles) and dropped with ``freqs``: afterwards only the backward's saved ones live."""
    hit = _ANGLES.get(id(freqs))
    if hit is not None and hit[0].dtype == dtype:
        return hit
    if hit is None:
        weakref.finalize(freqs, _ANGLES.pop, id(freqs), None)
    flat = freqs.reshape(freqs.shape[0], freqs.shape[-1])
    _ANGLES[id(freqs)] = hit = tuple(x.to(dtype).contiguous() for x in (torch.cos(flat), torch.sin(flat)))
    return hit


def fused_rope(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False, **_: Any) -> torch.Tensor:
    """Megatron's ``fused_apply_rotary_pos_emb(t, freqs, interleaved=...)``: t (s, b, heads, d),
    freqs (s, 1, 1, rot) angles. The native kernel on a CPU (meta tensors alike in a dry run of a
    CPU learner); Megatron's unfused function for anything else (another device, interleaved pairs,
    angles per batch row, a dtype without a kernel). A dry run planning a GPU's kernels does not
    route it in (``forward.packed_forward``'s ``fused_plan``)."""
    fn = None
    if not interleaved and t.device.type == "cpu":
        fn = _kernel(t.dtype)
    elif not interleaved and t.device.type == "meta":  # a dry run of a CPU learner
        fn = _META
    if (
        fn is None
        or freqs.dim() != 4
        or freqs.shape[0] != t.shape[0]
        or freqs.shape[1] != 1
        or freqs.shape[2] != 1
        or freqs.shape[-1] > t.shape[-1]
        or freqs.requires_grad
    ):
        from megatron.core.models.common.embeddings import rope_utils

        return rope_utils._apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved)
    cos, sin = _cos_sin(freqs, t.dtype)
    if torch.is_grad_enabled() and t.requires_grad:
        return _Rope.apply(t, cos, sin, fn)
    return _run(fn, t.contiguous(), cos, sin, 1.0)


def install_fused_rope(model: Any) -> int:
    """Route the rotary embedding of every Megatron ``SelfAttention`` on the CPU (or meta: a dry run)
    through ``fused_rope`` (idempotent); how many it routed. Nothing changes where Megatron has a fused
    RoPE of its own (Transformer Engine), where the kernel cannot be built, or for rotary with
    YaRN's scale or multi-latent attention (other paths)."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer.attention import SelfAttention

    if rope_utils.fused_apply_rotary_pos_emb not in (None, fused_rope) or _kernel(torch.float32) is None:
        return 0
    count = 0
    for m in model.modules():
        if not isinstance(m, SelfAttention):
            continue
        cfg = m.config
        if cfg.apply_rope_fusion:
            count += getattr(cfg, "_agent_r1_rope", False)
            continue
        weight = getattr(m.linear_qkv, "weight", None)
        if (
            weight is None
            or weight.device.type not in ("cpu", "meta")
            or cfg.rotary_interleaved
            or cfg.multi_latent_attention
            or getattr(cfg, "rope_type", "rope") != "rope"
        ):
            continue
        rope_utils.fused_apply_rotary_pos_emb = fused_rope  # consulted only where apply_rope_fusion is set
        m.config = copy.copy(cfg)  # this attention's own: the flag below reaches no other module
        m.config.apply_rope_fusion = True
        m.config._agent_r1_rope = True
        count += 1
    return count
