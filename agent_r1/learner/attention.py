"""Attention within each packed sequence for the local layer spec: ``PackedAttention`` runs the
core attention as causal SDPA per sequence, sequences of similar length batched into one call
(``AttentionPlan``: O(sum of len^2), no N x N mask); short bf16 buckets take a matmul attention
with a native causal softmax (``matmul_causal_attention``)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from agent_r1 import native
from megatron_bridge.config import gpt_model


@dataclass
class _Bucket:
    rows: torch.Tensor  # (nb * L,) stream rows gathered into the padded block (a pad repeats a real row)
    keep: torch.Tensor | None  # (real rows,) their places in the block; None: every place is one
    nb: int
    L: int
    dest: torch.Tensor  # (real rows,) the stream rows of those places: rows[keep]
    pads: torch.Tensor | None  # the places whose output is dropped (pads, shared prefix rows); None: none
    shared: bool = False  # a block holds rows of another sequence's prefix (``AttentionPlan.of``'s parents)


@dataclass
class AttentionPlan:
    """The sequences of a packed stream in buckets of similar length: one causal SDPA call per
    bucket instead of one per sequence; each bucket's real rows go back to their places in the
    stream (``_Bucket.dest``).

    A bucket's sequences are padded at their ends, so the causal mask alone keeps each real row to
    its own sequence's keys (pads come after them); the pad rows' outputs are dropped, so they pass
    no gradient to anything. No explicit mask: the CPU flash kernel then skips the blocks above the
    diagonal instead of reading an (L x L) mask (the attention of a SmolLM2-shaped bf16 update:
    1.38 -> 0.97 s).

    A sequence with a parent (a shared prefix: ``Packed.parents``) is a branch: its block holds the
    parent's rows, then its own, so its rows attend to the prefix as if it were their own; the
    prefix rows' outputs there are dropped (their own sequence computes them once), while their
    keys and values collect the gradient of every branch that reads them."""

    buckets: list[_Bucket]
    cp: Any = None  # context parallelism: keys and values all-gathered over the CP ranks
    cp_mask: torch.Tensor | None = None  # (1, 1, rows, cp * rows) bool, True = attend
    fused: bool = False  # a plan of a GPU's fused attention (``Backend.fused_plan``): no buckets, no masks

    @classmethod
    def of(
        cls,
        bounds: list[tuple[int, int]],
        device: torch.device,
        fill: float = 0.8,
        parents: list[tuple[int, int]] | None = None,
    ) -> AttentionPlan:
        """Buckets from the longest sequence down, each at least ``fill`` real rows. ``parents``:
        per sequence the (start, length) of the prefix it continues ((0, 0): none)."""
        starts = np.array([a for a, _ in bounds], dtype=np.int64)
        own = np.array([e - a for a, e in bounds], dtype=np.int64)
        p_start = np.array([a for a, _ in parents], dtype=np.int64) if parents else np.zeros_like(own)
        p_len = np.array([n for _, n in parents], dtype=np.int64) if parents else np.zeros_like(own)
        lengths = p_len + own
        order = np.argsort(-lengths, kind="stable")
        buckets, i = [], 0
        while i < len(order):
            L = int(lengths[order[i]])
            j, total = i + 1, L  # the longest sequence opens the bucket
            while j < len(order) and total + lengths[order[j]] >= fill * L * (j - i + 1):
                total += int(lengths[order[j]])
                j += 1
            members = order[i:j]
            pos = np.arange(L)[None, :]
            plen, ps, a = p_len[members][:, None], p_start[members][:, None], starts[members][:, None]
            in_parent = pos < plen
            valid = ~in_parent & (pos < lengths[members][:, None])  # (nb, L): the sequence's own rows
            first = np.where(plen > 0, ps, a)
            rows = np.where(in_parent, ps + pos, np.where(valid, a + pos - plen, first)).ravel()
            keep, pads = np.flatnonzero(valid.ravel()), np.flatnonzero(~valid.ravel())
            t = lambda x: torch.from_numpy(x).to(device)  # noqa: E731
            padded = len(pads) > 0
            buckets.append(
                _Bucket(
                    t(rows),
                    t(keep) if padded else None,
                    j - i,
                    L,
                    t(rows[keep]),
                    t(pads) if padded else None,
                    shared=bool((plen > 0).any()),
                )
            )
            i = j
        return cls(buckets)


class PackedAttention(torch.nn.Module):
    """Drop-in for a local-spec ``core_attention`` (Megatron's ``DotProductAttention``, which
    needs an N x N mask): while the box holds a plan, causal SDPA within each packed sequence,
    sequences of similar length batched into one call (``AttentionPlan``)."""

    def __init__(self, inner: torch.nn.Module, box: dict[str, Any]):
        super().__init__()
        self.inner = inner
        self.box = box  # shared by every layer: {"plan": AttentionPlan or None}

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: Any = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        plan: AttentionPlan | None = self.box["plan"]
        if plan is not None and plan.cp is not None:  # every CP rank's keys and values
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            key, value = (  # (contiguous: the QKV split's views; backward: each rank's rows get
                gather_from_sequence_parallel_region(  # the sum of every rank's gradient)
                    x.contiguous(), tensor_parallel_output_grad=True, group=plan.cp.group
                )
                for x in (key, value)
            )
        if plan is not None and plan.fused:  # a GPU's fused attention, planned
            from agent_r1.learner.backend.fused_plan import fused_attention

            sq, b, heads, hn = query.shape
            out = fused_attention(query.squeeze(1), key.squeeze(1), value.squeeze(1))
            return out.view(sq, b, heads * hn)
        if plan is None:
            return self.inner(
                query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params
            )
        sq, b, heads, hn = query.shape  # [s, 1, heads, hn]; key/value [s, 1, groups, hn]
        if plan.cp is not None:
            q, k, v = (x.squeeze(1).transpose(0, 1).unsqueeze(0) for x in (query, key, value))
            o = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=plan.cp_mask,
                scale=self.inner.softmax_scale,
                enable_gqa=k.shape[1] != heads,
            )  # (1, heads, s, hn)
            return o[0].transpose(0, 1).reshape(sq, b, heads * hn)
        q, k, v = query.squeeze(1), key.squeeze(1), value.squeeze(1)  # views: a select's backward would copy
        dtype, scale = q.dtype, self.inner.softmax_scale
        low = q.device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)
        wide = None  # float32 q, k, v for the flash kernel, made once if a bucket needs them
        outs = []
        short = [bk for bk in plan.buckets if low and bk.L <= MATMUL_ATTENTION_MAX_LEN]
        blocks = {}  # each short bucket's q, k and v blocks, gathered together (one backward each)
        if short:
            qs, ks, vs = (_BucketRows.apply(x, short) for x in (q, k, v))
            blocks = {id(bk): qkv for bk, *qkv in zip(short, qs, ks, vs, strict=True)}
        for bk in plan.buckets:
            if id(bk) in blocks:
                qb, kb, vb = (x.view(bk.nb, bk.L, x.shape[1], hn) for x in blocks[id(bk)])
                o = matmul_causal_attention(qb, kb, vb, scale).reshape(bk.nb * bk.L, heads * hn)
            else:
                if wide is None:
                    # PyTorch's CPU flash attention runs faster in float32 than in bf16 (forward +
                    # backward of a SmolLM2 bucket: 25 against 29-37 ms), and is exact-er; the
                    # output goes back to bf16
                    wide = tuple(x.float() for x in (q, k, v)) if low else (q, k, v)
                qb, kb, vb = (
                    x.index_select(0, bk.rows).view(bk.nb, bk.L, x.shape[1], hn).transpose(1, 2) for x in wide
                )
                o = (
                    F.scaled_dot_product_attention(
                        qb, kb, vb, is_causal=True, scale=scale, enable_gqa=kb.shape[1] != heads
                    )
                    .transpose(1, 2)
                    .reshape(bk.nb * bk.L, heads * hn)
                )
            outs.append(o.to(dtype))
        return _StreamRows.apply(plan.buckets, *outs).view(sq, b, heads * hn)


class _BucketRows(torch.autograd.Function):
    """x (N, ...) -> each bucket's padded block x[rows] (nb * L, ...). The backward writes each real
    row's gradient from its one place in its block, pads dropped (their gradient is zero:
    ``AttentionPlan``): one pass, instead of a zero-filled N-row tensor, a scatter-add and a sum
    per bucket (``index_select``'s backward, which allows for repeated rows). A shared prefix's
    rows in a branch's block then add their gradient (a key's and a value's: what the branch's rows
    read of them) to the same rows."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, buckets: list[_Bucket]) -> tuple[torch.Tensor, ...]:
        ctx.buckets, ctx.shape = buckets, x.shape
        return tuple(x.index_select(0, bk.rows) for bk in buckets)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        covered = sum(len(bk.dest) for bk in ctx.buckets) == ctx.shape[0]
        dx = grads[0].new_empty(ctx.shape) if covered else grads[0].new_zeros(ctx.shape)
        for bk, g in zip(ctx.buckets, grads, strict=True):
            dx.index_copy_(0, bk.dest, g if bk.keep is None else g.index_select(0, bk.keep))
        for bk, g in zip(ctx.buckets, grads, strict=True):  # a shared prefix's rows: every branch adds
            if bk.shared:
                dx.index_add_(0, bk.rows[bk.pads], g.index_select(0, bk.pads))
        return dx, None


class _StreamRows(torch.autograd.Function):
    """The buckets' (nb * L, F) outputs -> their real rows in stream order (N, F). The backward
    gathers each block's gradient from the stream, zero at its pads."""

    @staticmethod
    def forward(ctx, buckets: list[_Bucket], *outs: torch.Tensor) -> torch.Tensor:
        ctx.buckets = buckets
        n = sum(len(bk.dest) for bk in buckets)
        out = outs[0].new_empty((n, *outs[0].shape[1:]))
        for bk, o in zip(buckets, outs, strict=True):
            out.index_copy_(0, bk.dest, o if bk.keep is None else o.index_select(0, bk.keep))
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        grads = []
        for bk in ctx.buckets:
            g = dout.index_select(0, bk.rows)
            if bk.pads is not None:
                g.index_fill_(0, bk.pads, 0)
            grads.append(g)
        return None, *grads


# On a CPU, bf16 attention over sequences up to this long runs as plain matmuls (below): forward +
# backward of (nb, L) buckets of ~1,300 tokens, SmolLM2's heads, 2 threads with AVX512_BF16 against
# the float32 flash kernel: L=128 5-6 vs 12.5 ms, 256 9-12 vs 20, 512 17-25 vs 30, 1024 46-55 vs 51.
# The (L x L) probabilities it keeps for the backward grow as L^2, so longer buckets keep to flash.
MATMUL_ATTENTION_MAX_LEN = 512


def matmul_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of (nb, L, heads, hn) queries over (nb, L, groups, hn) keys and values
    (grouped-query: head h reads group h // (heads // groups)) as three batched matmuls in the
    inputs' dtype -> (nb, L, heads, hn). The query heads of a group are stacked along the rows, so
    each group's keys are read once. On a CPU the raw scores go through ``native/causal_softmax.cpp``
    (the scale inside, each row over its causal columns, in place); elsewhere the scores take the
    scale and the causal -inf in one ``baddbmm``. The softmax (float32 inside) gives the
    probabilities in the inputs' dtype, as HF's eager attention and Megatron's unfused one keep
    them. Autograd keeps those probabilities (nb x heads x L^2) for the backward."""
    nb, L, heads, hn = q.shape
    groups = k.shape[2]
    g = heads // groups
    qg = q.view(nb, L, groups, g, hn).permute(0, 2, 3, 1, 4).reshape(nb * groups, g * L, hn)
    kg, vg = (x.permute(0, 2, 1, 3).reshape(nb * groups, L, hn) for x in (k, v))
    fns = _causal_softmax_kernels(q.dtype) if q.device.type == "cpu" else None
    if fns is not None:  # native: each row's softmax over its causal columns only
        p = _CausalSoftmax.apply(torch.bmm(qg, kg.transpose(1, 2)), scale, fns)
    else:
        causal = torch.full((L, L), float("-inf"), dtype=q.dtype, device=q.device).triu_(1).repeat(g, 1)
        p = torch.softmax(torch.baddbmm(causal, qg, kg.transpose(1, 2), alpha=scale), dim=-1)
    o = torch.bmm(p, vg)  # (nb * groups, g * L, hn)
    return o.view(nb, groups, g, L, hn).permute(0, 3, 1, 2, 4).reshape(nb, L, heads, hn)


class _CausalSoftmax(torch.autograd.Function):
    """softmax(scale * s) of raw (B, g * L, L) scores whose row r is query position r mod L, over
    the columns up to it (the rest 0), in place of ``s`` (``native/causal_softmax.cpp``)."""

    @staticmethod
    def forward(ctx, s: torch.Tensor, scale: float, fns: Any) -> torch.Tensor:
        B, R, L = s.shape
        native.call(fns[0], s, scale, s, B, R, L)
        ctx.mark_dirty(s)
        ctx.save_for_backward(s)
        ctx.scale, ctx.fns = scale, fns
        return s

    @staticmethod
    def backward(ctx, dp: torch.Tensor):
        (p,) = ctx.saved_tensors
        ds = torch.empty_like(p)
        native.call(ctx.fns[1], p, dp.contiguous(), ctx.scale, ds, *p.shape)
        return ds, None, None


@functools.cache
def _causal_softmax_kernels(dtype: torch.dtype) -> tuple[Any, Any] | None:
    return native.forward_backward("causal_softmax", dtype, "p f32 p i32 i32 i32", "p p f32 p i32 i32 i32")


def install_packed_attention(model: Any) -> dict[str, Any] | None:
    """Wrap every layer's local-spec core attention in ``PackedAttention`` (idempotent); the box
    whose ``bounds`` the forward sets, or None where a layer needs what SDPA here does not do
    (Transformer Engine's attention, dropout, softmax offset, sliding window, QK layer scaling)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    m = gpt_model(model)
    box = getattr(m, "_packed_attention_box", None)
    if box is not None:
        return box
    layers = list(m.decoder.layers) if getattr(m, "decoder", None) is not None else []
    cores = [layer.self_attention.core_attention for layer in layers]
    ok = all(
        isinstance(c, DotProductAttention)  # (or the bridge's context-parallel form of it)
        and c.attention_dropout.p == 0
        and getattr(c, "softmax_offset", None) is None
        and getattr(c.config, "window_size", None) is None
        and not c.config.apply_query_key_layer_scaling
        for c in cores
    )
    if not ok:
        return None
    box = {"plan": None}
    for layer, core in zip(layers, cores, strict=True):
        layer.self_attention.core_attention = PackedAttention(core, box)
    m._packed_attention_box = box
    return box
