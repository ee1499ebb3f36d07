"""Policy forward on packed streams: per-token logprobs and entropy from vocab-parallel logits.

``PackedRotary`` lets Megatron's GPTModel take explicit per-token positions (restarting per
packed sequence) on any layer spec; ``PackedAttention`` runs the local spec's core attention as
causal SDPA within each packed sequence (O(sum of len^2), no N x N mask); ``vocab_parallel_logprob_entropy`` reduces across the tensor-
parallel group (max, sum-exp, target logit, expected logit) with its own backward, so the full
vocabulary is never gathered, and recomputes its fp32 exponentials in the backward (the chunk
and per-row numbers are all it keeps); ``packed_logprobs`` runs it in chunks of label tokens so a
long stream never materialises an fp32 (tokens x vocab) tensor.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from agent_r1 import native
from agent_r1.learner import context_parallel
from agent_r1.learner.activation import install_fused_swiglu
from agent_r1.learner.norm import install_fused_rms_norm
from agent_r1.learner.packing import Packed
from agent_r1.learner.rope import install_fused_rope


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


@dataclass
class _Bucket:
    rows: torch.Tensor  # (nb * L,) stream rows gathered into the padded block (a pad repeats a real row)
    keep: torch.Tensor | None  # (real rows,) their places in the block; None: no padding
    nb: int
    L: int
    dest: torch.Tensor  # (real rows,) the stream rows of those places: rows[keep]
    pads: torch.Tensor | None  # the block's pad places (None: no padding)


@dataclass
class AttentionPlan:
    """The sequences of a packed stream in buckets of similar length: one causal SDPA call per
    bucket instead of one per sequence; each bucket's real rows go back to their places in the
    stream (``_Bucket.dest``).

    A bucket's sequences are padded at their ends, so the causal mask alone keeps each real row to
    its own sequence's keys (pads come after them); the pad rows' outputs are dropped, so they pass
    no gradient to anything. No explicit mask: the CPU flash kernel then skips the blocks above the
    diagonal instead of reading an (L x L) mask (the attention of a SmolLM2-shaped bf16 update:
    1.38 -> 0.97 s)."""

    buckets: list[_Bucket]
    cp: Any = None  # context parallelism: keys and values all-gathered over the CP ranks
    cp_mask: torch.Tensor | None = None  # (1, 1, rows, cp * rows) bool, True = attend

    @classmethod
    def of(cls, bounds: list[tuple[int, int]], device: torch.device, fill: float = 0.8) -> AttentionPlan:
        """Buckets from the longest sequence down, each at least ``fill`` real rows."""
        starts = np.array([a for a, _ in bounds], dtype=np.int64)
        lengths = np.array([e - a for a, e in bounds], dtype=np.int64)
        order = np.argsort(-lengths, kind="stable")
        buckets, i = [], 0
        while i < len(order):
            L = int(lengths[order[i]])
            j, total = i + 1, L  # the longest sequence opens the bucket
            while j < len(order) and total + lengths[order[j]] >= fill * L * (j - i + 1):
                total += int(lengths[order[j]])
                j += 1
            members = order[i:j]
            pos = np.arange(L)
            valid = pos[None, :] < lengths[members][:, None]  # (nb, L)
            rows = np.where(valid, starts[members][:, None] + pos[None, :], starts[members][:, None]).ravel()
            keep, pads = np.flatnonzero(valid.ravel()), np.flatnonzero(~valid.ravel())
            t = lambda x: torch.from_numpy(x).to(device)  # noqa: E731
            padded = len(pads) > 0
            buckets.append(
                _Bucket(
                    t(rows), t(keep) if padded else None, j - i, L, t(rows[keep]), t(pads) if padded else None
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
        from agent_r1.learner import dry_run

        plan: AttentionPlan | None = self.box["plan"]
        if plan is not None and plan.cp is not None:  # every CP rank's keys and values
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            key, value = (  # (contiguous: the QKV split's views; backward: each rank's rows get
                gather_from_sequence_parallel_region(  # the sum of every rank's gradient)
                    x.contiguous(), tensor_parallel_output_grad=True, group=plan.cp.group
                )
                for x in (key, value)
            )
        if plan is not None and dry_run.fused():  # a GPU's fused attention, planned
            sq, b, heads, hn = query.shape
            out = dry_run.fused_attention(query.squeeze(1), key.squeeze(1), value.squeeze(1))
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
    per bucket (``index_select``'s backward, which allows for repeated rows)."""

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


def _unwrap(model: Any) -> Any:
    while not hasattr(model, "decoder") and hasattr(model, "module"):
        model = model.module
    return model


def install_packed_attention(model: Any) -> dict[str, Any] | None:
    """Wrap every layer's local-spec core attention in ``PackedAttention`` (idempotent); the box
    whose ``bounds`` the forward sets, or None where a layer needs what SDPA here does not do
    (Transformer Engine's attention, dropout, softmax offset, sliding window, QK layer scaling)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    m = _unwrap(model)
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


def _shifted(
    logits: torch.Tensor, temperature: float, vocab_start: int, vocab_size: int | None
) -> torch.Tensor:
    """fp32 logits / T, with the TP padding columns (at or beyond ``vocab_size``) at -1e30."""
    z = logits.float()
    if temperature != 1.0:  # on the fp32 copy of this chunk: no extra (rows x vocab) tensor
        z = z / temperature
    if vocab_size is not None and vocab_start + z.shape[-1] > vocab_size:
        pad = torch.arange(z.shape[-1], device=z.device) + vocab_start >= vocab_size
        z = z.masked_fill(pad, -1e30)  # finite: exp() gives 0 and 0 * logit stays 0
    return z


class _VocabParallelLogprob(torch.autograd.Function):
    """Logprob and entropy of a (rows, V/tp) logits chunk. The backward recomputes the fp32
    exponentials from the chunk as given (its dtype: bf16 in a bf16 model) and the row maxima:
    what stays alive between forward and backward is the chunk itself and a few numbers per row,
    not two fp32 (rows x V/tp) tensors (8 bytes per logit: the largest term of a long
    micro-batch's memory on a GPU, found by ``agent-r1 plan``)."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group, temperature, vocab_size):
        """logits (A, V/tp), targets (A,) global ids -> logprob (A,), entropy (A,) in fp32."""
        ctx.set_materialize_grads(False)  # an unused output (the entropy, usually) gets no gradient
        width = logits.shape[-1]
        local = (targets - vocab_start).clamp(0, width - 1)
        inside = (targets >= vocab_start) & (targets < vocab_start + width)
        kernel = _LogprobKernel.of(logits, temperature, vocab_start, vocab_size)
        if kernel is not None:  # the same numbers, one row at a time in cache (agent_r1/native)
            m = kernel.row_max()
            if group is not None:
                dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            stats = kernel.row_stats(m, local, inside)
        else:
            z = _shifted(logits, temperature, vocab_start, vocab_size)  # may be ``logits`` itself
            m = z.max(-1).values
            if group is not None:
                dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            z = z - m.unsqueeze(-1)
            ex = z.exp()
            tz = torch.where(inside, z.gather(-1, local.unsqueeze(-1)).squeeze(-1), torch.zeros_like(m))
            ez = torch.bmm(ex.unsqueeze(1), z.unsqueeze(2)).view(
                -1
            )  # sum_j ex_j z_j without an (A, V) product
            stats = torch.stack([ex.sum(-1), ez, tz], -1)
        if group is not None:
            dist.all_reduce(stats, group=group)
        sumexp, ez, tz = stats.unbind(-1)
        lse = sumexp.log()
        logprob = tz - lse
        entropy = lse - ez / sumexp
        ctx.save_for_backward(logits, m, local, inside, sumexp, lse, entropy)
        ctx.shift = (temperature, vocab_start, vocab_size)
        return logprob, entropy

    @staticmethod
    def backward(ctx, g_lp: torch.Tensor | None, g_ent: torch.Tensor | None):
        logits, m, local, inside, sumexp, lse, entropy = ctx.saved_tensors
        temperature, vocab_start, vocab_size = ctx.shift
        kernel = _LogprobKernel.of(logits, temperature, vocab_start, vocab_size)
        if kernel is not None:
            grad = kernel.row_grad(m, sumexp, lse, entropy, g_lp, g_ent, local, inside)
            return grad, None, None, None, None, None
        z = _shifted(logits, temperature, vocab_start, vocab_size) - m.unsqueeze(-1)
        ex = z.exp()
        # p_j = ex_j / sumexp;  d logprob / d z_j = 1[j = target] - p_j;  d H / d z_j = -p_j (log p_j + H)
        # (the gradient is written into ``ex``, the chunk's fp32 recomputation)
        coef = torch.zeros_like(sumexp) if g_lp is None else -g_lp
        if g_ent is None:
            grad = ex.mul_((coef / sumexp).unsqueeze(-1))
        else:  # log p_j + H = z_j - lse + H
            shift = (entropy - lse).unsqueeze(-1)
            w = z.add_(shift).mul_(-g_ent.unsqueeze(-1)).add_(coef.unsqueeze(-1))  # in place too
            grad = ex.mul_(w).div_(sumexp.unsqueeze(-1))
        if g_lp is not None:
            grad.scatter_add_(-1, local.unsqueeze(-1), (g_lp * inside).unsqueeze(-1))
        if temperature != 1.0:  # z = logits / T
            grad.div_(temperature)
        return grad.to(logits.dtype), None, None, None, None, None


class _LogprobKernel:
    """``agent_r1/native/logprob.cpp`` over one contiguous (A, V/tp) logits block on a CPU
    (float32 or bf16); ``of`` gives None elsewhere (a GPU, no compiler): the PyTorch path."""

    def __init__(self, fns, logits, temperature, vocab_start, vocab_size):
        self.fns, self.x = fns, logits
        self.A, self.W = logits.shape
        self.V = self.W if vocab_size is None else max(0, min(self.W, vocab_size - vocab_start))
        self.inv_t = 1.0 / temperature

    @classmethod
    def of(cls, logits, temperature, vocab_start, vocab_size) -> _LogprobKernel | None:
        if logits.device.type != "cpu" or logits.dim() != 2 or not logits.is_contiguous():
            return None
        fns = _logprob_kernels(logits.dtype)
        return None if fns is None else cls(fns, logits, temperature, vocab_start, vocab_size)

    def _call(self, fn, *args):
        native.call(fn, *(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args))

    def row_max(self) -> torch.Tensor:
        m = torch.empty(self.A, dtype=torch.float32)
        self._call(self.fns[0], self.x, self.x.stride(0), self.A, self.V, self.inv_t, m)
        return m

    def row_stats(self, m, local, inside) -> torch.Tensor:
        stats = torch.empty(self.A, 3, dtype=torch.float32)
        inside8 = inside.to(torch.uint8)
        self._call(
            self.fns[1], self.x, self.x.stride(0), self.A, self.V, self.inv_t, m, local, inside8, stats
        )
        return stats

    def row_grad(self, m, sumexp, lse, entropy, g_lp, g_ent, local, inside) -> torch.Tensor:
        grad = torch.empty((self.A, self.W), dtype=self.x.dtype)
        g_lp = None if g_lp is None else g_lp.float()
        g_ent = None if g_ent is None else g_ent.float()
        args = (self.x, self.x.stride(0), self.A, self.V, self.W, self.inv_t, m, sumexp, lse, entropy)
        self._call(self.fns[2], *args, g_lp, g_ent, local.long(), inside.to(torch.uint8), grad)
        return grad


@functools.cache
def _logprob_kernels(dtype: torch.dtype):
    head = "p i64 i32 i32"
    fns = (
        native.function("logprob", "agent_r1_logprob_max", dtype, f"{head} f32 p"),
        native.function("logprob", "agent_r1_logprob_stats", dtype, f"{head} f32 p p p p"),
        native.function("logprob", "agent_r1_logprob_grad", dtype, f"{head} i32 f32 {' '.join(['p'] * 9)}"),
    )
    return None if None in fns else fns


def vocab_parallel_logprob_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int = 0,
    group: Any = None,
    vocab_size: int | None = None,
    temperature: float = 1.0,
):
    """Per-row logprob of ``targets`` and entropy under softmax(logits / temperature) where
    ``logits`` holds this rank's vocabulary slice ``[vocab_start, vocab_start + V/tp)``; exact across
    TP ranks. Columns at or beyond ``vocab_size`` (the TP padding of the embedding) are excluded from
    the softmax."""
    return _VocabParallelLogprob.apply(logits, targets, vocab_start, group, temperature, vocab_size)


def packed_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    group: Any = None,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    chunk: int = 2048,
    temperature: float = 1.0,
):
    """(A,) logprobs of ``targets`` and entropies from (A, V/tp) logits, one row per target (the
    logits of the position before it), in chunks of rows so a long stream never materialises an
    fp32 (tokens x vocab) tensor. ``vocab_size``: the real vocabulary (the model's is padded for
    TP). ``temperature``: the sampler's (SGLang returns logprobs under softmax(logits / T)), > 0."""
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    if targets.numel() <= chunk:  # no split: its backward would copy the whole gradient once more
        return vocab_parallel_logprob_entropy(logits, targets, vocab_start, group, vocab_size, temperature)
    parts = [
        vocab_parallel_logprob_entropy(lg, tg, vocab_start, group, vocab_size, temperature)
        for lg, tg in zip(logits.split(chunk), targets.split(chunk), strict=True)  # split, not slices:
    ]  # a slice's backward writes into a zero tensor of the full size, once per chunk
    return torch.cat([lp for lp, _ in parts]), torch.cat([e for _, e in parts])


def install_output_rows(model: Any) -> dict[str, Any] | None:
    """Let the output layer project only chosen rows of the final hidden states (idempotent):
    while the returned box's ``rows`` is set, ``output_layer`` sees ``hidden[rows]``. The loss
    reads logits only before action tokens (and the critic only at step starts), so the
    vocabulary projection and its backward skip every observation token. The layer keeps its
    name (its ``forward`` is wrapped), so checkpoints and weight export are unchanged. None on
    stages without an output layer.

    With sequence parallelism each TP rank holds 1/tp of the stream's rows: they are gathered
    first (the backward hands each rank its own slice of the gradient), the rows chosen from the
    whole stream, and the layer then runs as without sequence parallelism (its input gradient
    summed over the TP ranks, as each holds a slice of the vocabulary)."""
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    m = _unwrap(model)
    layer = getattr(m, "output_layer", None)
    if layer is None:
        return None
    box = getattr(m, "_output_rows_box", None)
    if box is not None:
        return box
    box = {"rows": None}
    inner = layer.forward
    split = bool(m.config.sequence_parallel and m.config.tensor_model_parallel_size > 1)

    def forward(hidden: torch.Tensor, *args: Any, **kwargs: Any):
        rows = box["rows"]
        if split:
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        if rows is not None:
            hidden = hidden.index_select(0, rows)
        if not split or not hasattr(layer, "allreduce_dgrad"):
            return inner(hidden, *args, **kwargs)
        layer.sequence_parallel, layer.allreduce_dgrad = False, True  # the rows are whole now
        try:
            return inner(hidden, *args, **kwargs)
        finally:
            layer.sequence_parallel, layer.allreduce_dgrad = True, False

    layer.forward = forward
    m._output_rows_box = box
    return box


def _uses_te(model: Any) -> bool:
    inner = _unwrap(model)
    layer = inner.decoder.layers[0] if hasattr(inner, "decoder") and len(inner.decoder.layers) else None
    return layer is not None and "TE" in type(layer.self_attention.core_attention).__name__


def packed_forward(
    model: Any, packed: Packed, rows: torch.Tensor | None = None, vision: Any = None
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
    (mRoPE) and take the local spec's ``PackedRotary``."""

    out_rows = install_output_rows(model)  # also gathers a sequence-parallel stream's rows
    if out_rows is not None:
        out_rows["rows"] = rows
    try:
        out = _forward(model, packed, vision)
    finally:
        if out_rows is not None:
            out_rows["rows"] = None
    # last stage: (1, rows, V/tp) -> (rows, V/tp); other stages: hidden states for the next stage
    return out.squeeze(0) if _unwrap(model).post_process else out  # a view: indexing's backward copies


def _image_input(model: Any, packed: Packed, vision: Any) -> torch.Tensor | None:
    """The first stage's input embeddings with the image pads' rows from the vision tower."""
    if not packed.images:
        return None
    m = _unwrap(model)
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


def _forward(model: Any, packed: Packed, vision: Any = None) -> torch.Tensor:
    from agent_r1.learner import dry_run

    multimodal = packed.positions.dim() == 2
    cfg = _unwrap(model).config
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
    install_fused_rms_norm(model)
    install_fused_swiglu(model)
    install_fused_rope(model)
    rotary.positions = packed.positions
    decoder_input = _image_input(model, packed, vision)
    positions = packed.positions[0] if multimodal else packed.positions  # (rope angles: PackedRotary)
    if attention is not None:
        if "attention" not in packed.cache:  # the same for every pass over this micro-batch
            if dry_run.fused():  # a dry run plans fused attention: no buckets, no masks
                plan = AttentionPlan([], packed.cp)
            elif packed.cp is not None:  # every CP rank's keys, masked by place in the sequence
                plan = AttentionPlan([], packed.cp, context_parallel.attention_mask(packed.cp))
            else:
                plan = AttentionPlan.of(packed.bounds, packed.tokens.device)
            packed.cache["attention"] = plan
        attention["plan"] = packed.cache["attention"]
    try:
        mask = None if attention is not None else packed.attention_mask()
        return model(packed.tokens.unsqueeze(0), positions.unsqueeze(0), mask, decoder_input=decoder_input)
    finally:
        rotary.positions = None
        if attention is not None:
            attention["plan"] = None
