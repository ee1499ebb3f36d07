"""Context parallelism: every packed micro-batch split over the CP ranks of a data-parallel
replica, in the layout Transformer Engine's THD attention takes.

Each sequence is padded to a multiple of ``2 * cp`` rows and cut into ``2 * cp`` equal chunks;
CP rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r`` of every sequence (one early, one late
chunk: causal attention costs every rank the same). Its rows run through the model as a packed
stream of their own; attention reads every rank's keys and values (all-gathered, their gradients
summed back), masked by each row's place in its sequence. The output layer projects the rows this
rank holds of the ones the loss reads; ``gather_rows`` assembles every rank's into the full
per-token (or per-step) vector, identical on every CP rank, and hands each rank its own rows'
gradient back, so the loss code is the same as without CP. Each CP rank's parameter gradient is
then the part of its own rows: Megatron's DDP sums them over the data- and context-parallel ranks,
and its schedule multiplies the loss by ``cp`` to undo the average's division.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from agent_r1.learner.packing import Packed


@dataclass
class CPShard:
    """What one CP rank holds of a micro-batch, and where every rank's rows sit."""

    group: Any
    size: int
    rank: int
    rows: torch.Tensor  # (n,) this rank's rows: their places in the padded stream
    all_rows: torch.Tensor  # (size * n,) every rank's, in all-gather order
    all_seq: torch.Tensor  # (size * n,) their sequences
    cu_padded: torch.Tensor  # (S + 1,) int32 padded sequence starts (TE's cu_seqlens_*_padded)
    cu_real: torch.Tensor  # (S + 1,) int32 cumulative real lengths (TE's cu_seqlens_*)
    max_padded: int  # the longest padded sequence
    targets: torch.Tensor  # (A,) every label's token
    label_rows: torch.Tensor  # local rows of the labels this rank holds (the row before each)
    label_idx: list[torch.Tensor]  # per rank: which of the micro-batch's labels it holds
    step_rows: torch.Tensor  # local rows of the step starts this rank holds (the critic's)
    step_idx: list[torch.Tensor]  # per rank: which of the micro-batch's steps it holds


def shard(packed: Packed, size: int, rank: int, group: Any, align: int = 1) -> Packed:
    """CP rank ``rank``'s part of ``packed`` (a micro-batch of the whole stream) as a packed
    stream of its own, with a ``CPShard`` in ``cp``; its length a multiple of ``align`` (sequence
    parallelism's tp, FP8's 16). Built once per micro-batch and rank (``packed.cache``)."""
    key = ("cp", size, rank, align)
    if key in packed.cache:
        return packed.cache[key]
    if packed.positions.dim() != 1:
        raise ValueError("context parallelism takes 1-D positions (not a vision-language model's mRoPE)")
    device = packed.tokens.device
    kept = packed.cache.get("host")  # LearnerBatch keeps them; else one copy from the device
    if kept is None:
        kept = {
            k: getattr(packed, f).detach().cpu().numpy()
            for k, f in (("tokens", "tokens"), ("positions", "positions"), ("label_pos", "label_pos"),
                         ("value_pos", "step_value_pos"))
        }  # fmt: skip
    tokens, positions = kept["tokens"], kept["positions"]
    label_pos, value_pos = kept["label_pos"], kept["value_pos"]
    two = 2 * size
    bounds = list(packed.bounds)
    chunk = [-(-(e - a) // two) for a, e in bounds]
    # a padding sequence, if needed, makes every rank's stream a multiple of ``align``
    # (each rank holds 2 * chunk rows of every sequence)
    m = align // 2 if align % 2 == 0 else align
    extra = -sum(chunk) % m
    if extra:
        chunk.append(extra)
        bounds.append((len(tokens), len(tokens)))  # no real rows
    padded = np.array(chunk) * two
    starts = np.concatenate([[0], np.cumsum(padded)])
    # the padded stream's row -> the micro-batch's row (-1: padding), and its sequence and position
    src = np.full(int(starts[-1]), -1, dtype=np.int64)
    seq = np.repeat(np.arange(len(padded)), padded)
    pos = np.concatenate([np.arange(p) for p in padded]) if len(padded) else np.zeros(0, np.int64)
    for i, (a, e) in enumerate(bounds):
        src[starts[i] : starts[i] + (e - a)] = np.arange(a, e)

    def rows_of(r: int) -> np.ndarray:
        return np.concatenate(
            [
                np.concatenate([s + r * c + np.arange(c), s + (two - 1 - r) * c + np.arange(c)])
                for s, c in zip(starts[:-1], chunk, strict=True)
            ]
        )

    every = [rows_of(r) for r in range(size)]
    mine = every[rank]
    where = {}  # the micro-batch's row -> (rank, local row)
    label_idx, step_idx = [], []
    for r, rows in enumerate(every):
        real = src[rows]
        local = {int(x): i for i, x in enumerate(real) if x >= 0}
        where[r] = local
        label_idx.append(
            np.array([k for k, p in enumerate(label_pos - 1) if int(p) in local], dtype=np.int64)
        )
        step_idx.append(np.array([k for k, p in enumerate(value_pos) if int(p) in local], dtype=np.int64))
    label_rows = np.array([where[rank][int(label_pos[k] - 1)] for k in label_idx[rank]], dtype=np.int64)
    step_rows = np.array([where[rank][int(value_pos[k])] for k in step_idx[rank]], dtype=np.int64)
    real_src = src[mine]
    local_tokens = np.where(real_src >= 0, tokens[np.maximum(real_src, 0)], 0)
    # a real row's position as packed; a padding row's continues its sequence's count
    local_pos = np.where(real_src >= 0, positions[np.maximum(real_src, 0)], pos[mine])
    local_seq = seq[mine]
    local_lens = np.bincount(local_seq, minlength=len(padded))
    local_cu = np.concatenate([[0], np.cumsum(local_lens)])
    real_lens = np.array([e - a for a, e in bounds])

    def dev(x: np.ndarray, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(x)).to(device=device, dtype=dtype)

    cp = CPShard(
        group=group,
        size=size,
        rank=rank,
        rows=dev(mine),
        all_rows=dev(np.concatenate(every)),
        all_seq=dev(seq[np.concatenate(every)]),
        cu_padded=dev(starts, torch.int32),
        cu_real=dev(np.concatenate([[0], np.cumsum(real_lens)]), torch.int32),
        max_padded=int(padded.max()) if len(padded) else 0,
        targets=packed.tokens[packed.label_pos],
        label_rows=dev(label_rows),
        label_idx=[dev(x) for x in label_idx],
        step_rows=dev(step_rows),
        step_idx=[dev(x) for x in step_idx],
    )
    out = dataclasses.replace(
        packed,
        tokens=dev(local_tokens),
        positions=dev(local_pos),
        seq_id=dev(local_seq),
        cu_seqlens=dev(local_cu),
        bounds=list(zip(local_cu[:-1].tolist(), local_cu[1:].tolist(), strict=True)),
        cache={},
        images=[],
        image_pos=None,
        cp=cp,
    )
    packed.cache[key] = out
    return out


def attention_mask(cp: CPShard) -> torch.Tensor:
    """(1, 1, n, size * n) bool, True = attend: this rank's rows against every rank's (all-gather
    order), within a sequence and causal by place in the padded stream."""
    q_rows, k_rows = cp.rows, cp.all_rows
    q_seq = cp.all_seq[cp.rank * len(q_rows) : (cp.rank + 1) * len(q_rows)]
    same = q_seq[:, None] == cp.all_seq[None, :]
    return (same & (k_rows[None, :] <= q_rows[:, None]))[None, None]


class _GatherRows(torch.autograd.Function):
    """Every CP rank's values at its share of a micro-batch's labels (or steps) -> the full vector,
    the same on every rank; the backward hands each rank its own entries' gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cp: CPShard, idx: list[torch.Tensor], total: int) -> torch.Tensor:
        width = max(len(i) for i in idx)
        buf = x.new_zeros((width,))
        buf[: len(x)] = x
        parts = [torch.empty_like(buf) for _ in range(cp.size)]
        dist.all_gather(parts, buf.contiguous(), group=cp.group)
        full = x.new_full((total,), float("nan"))
        for part, i in zip(parts, idx, strict=True):
            full[i] = part[: len(i)]
        ctx.mine = idx[cp.rank]
        return full

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[ctx.mine], None, None, None


def gather_rows(x: torch.Tensor, cp: CPShard, steps: bool = False, total: int | None = None) -> torch.Tensor:
    """The micro-batch's full (labels,) vector (``steps``: (steps,)) from each CP rank's ``x``."""
    idx = cp.step_idx if steps else cp.label_idx
    n = total if total is not None else sum(len(i) for i in idx)
    return _GatherRows.apply(x, cp, idx, n)
