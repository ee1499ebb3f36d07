"""Per-token logprobs and entropy from vocab-parallel logits: ``vocab_parallel_logprob_entropy``
reduces across the tensor-parallel group (max, sum-exp, target logit, expected logit) with its own
backward, so the full vocabulary is never gathered, and recomputes its fp32 exponentials in the
backward (the chunk and per-row numbers are all it keeps); ``packed_logprobs`` runs it in chunks of
label tokens so a long stream never materialises an fp32 (tokens x vocab) tensor;
``install_output_rows`` has the output layer compute only the rows a loss reads."""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.distributed as dist

from agent_r1 import native
from megatron_bridge.config import gpt_model


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

    m = gpt_model(model)
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


class _Aligned(torch.autograd.Function):
    @staticmethod
    def forward(ctx, computed: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
        return exact.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def aligned(computed: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """``exact``'s values with ``computed``'s gradient: the same function computed twice, its
    values taken from one computation and its gradient from the other (``computed + (exact -
    computed).detach()`` would round)."""
    if computed.shape != exact.shape:
        raise ValueError(f"aligned: {tuple(computed.shape)} logprobs against {tuple(exact.shape)}")
    return _Aligned.apply(computed, exact.to(computed.dtype))
