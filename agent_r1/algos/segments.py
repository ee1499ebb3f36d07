"""Segment primitives on flat streams: sums per segment, group statistics across ranks, whitening,
and the discounted reverse scan every return/GAE computation reduces to."""

from __future__ import annotations

import torch

from agent_r1.algos.reduce import LocalReducer, Reducer


def segment_sum(x: torch.Tensor, seg: torch.Tensor, num: int) -> torch.Tensor:
    """out[j] = sum of x[i] with seg[i] == j. x (N,), seg (N,) int64 -> (num,)."""
    return x.new_zeros(num).index_add_(0, seg, x)


def reverse_scan(x: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
    """y[i] = x[i] + decay[i] * y[i+1], with decay = 0 on the last element of every segment.

    Doubling scan: each round folds y[i+d] into y[i], so ceil(log2(longest segment)) rounds of
    vector ops, no loop over steps or tokens. Products of decays <= 1 keep it stable in float64.
    """
    if x.numel() == 0:
        return x.clone()
    if float(decay[-1]) != 0.0:
        raise ValueError("reverse_scan: decay must be 0 at the last element (segment end)")
    a, b = x.clone(), decay.clone()
    d, n = 1, x.numel()
    while d < n and bool(b.any()):
        a[:-d] = a[:-d] + b[:-d] * a[d:]
        b[:-d] = b[:-d] * b[d:]
        d *= 2
    return a


def segment_ends(seg: torch.Tensor) -> torch.Tensor:
    """(N,) bool: True where the next element belongs to another segment (or at the end)."""
    last = torch.ones_like(seg, dtype=torch.bool)
    if seg.numel() > 1:
        last[:-1] = seg[1:] != seg[:-1]
    return last


def group_stats(
    keys: torch.Tensor, x: torch.Tensor, reducer: Reducer | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean, unbiased std and size of each element's group, groups spanning ranks.

    keys (T,) int64 group keys, x (T,) float64 -> three (T,) tensors. Two passes (sums, then
    squared deviations around the global mean) so the result does not depend on sharding.
    """
    reducer = reducer or LocalReducer()
    u, inv = torch.unique(keys, return_inverse=True)
    stats = torch.stack([segment_sum(torch.ones_like(x), inv, len(u)), segment_sum(x, inv, len(u))], 1)
    all_keys, all_stats = reducer.allgather_cat(u), reducer.allgather_cat(stats)
    gu, ginv = torch.unique(all_keys, return_inverse=True)
    g = x.new_zeros(len(gu), 2).index_add_(0, ginv, all_stats)
    pos = torch.searchsorted(gu, u)
    count, mean = g[pos, 0], g[pos, 1] / g[pos, 0]
    m2 = segment_sum((x - mean[inv]) ** 2, inv, len(u))
    gm2 = segment_sum(reducer.allgather_cat(m2), ginv, len(gu))[pos]
    var = torch.where(count > 1, gm2 / (count - 1).clamp(min=1), torch.zeros_like(gm2))
    return mean[inv], var.sqrt()[inv], count[inv]


def whiten(
    x: torch.Tensor, weight: torch.Tensor | None = None, reducer: Reducer | None = None, eps: float = 1e-8
) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the whole (cross-rank) batch; weights count samples."""
    reducer = reducer or LocalReducer()
    w = torch.ones_like(x) if weight is None else weight.to(x.dtype)
    tot = reducer.allreduce_sum(torch.stack([w.sum(), (w * x).sum()]))
    if float(tot[0]) == 0:
        return torch.zeros_like(x)
    mean = tot[1] / tot[0]
    ss = reducer.allreduce_sum((w * (x - mean) ** 2).sum().reshape(1))[0]
    var = ss / (tot[0] - 1) if float(tot[0]) > 1 else torch.zeros_like(ss)
    return (x - mean) * torch.rsqrt(var + eps)
