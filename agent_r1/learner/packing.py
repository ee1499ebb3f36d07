"""Packed micro-batches: what one forward of the learner's model takes.

Sequences (prefix-merged trajectories, built by ``LearnerBatch``) sit back to back without
padding; positions restart per sequence and attention is block-diagonal causal. Every index a
loss or a value read needs is in the micro-batch: the stream position of each action token
(``label_pos``), its step inside the micro-batch (``label_step``), and where its values live in
the batch's flat arrays (``act_index`` for action tokens, ``step_index`` for steps).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass
class Packed:
    tokens: torch.Tensor  # (N,) int64
    positions: torch.Tensor  # (N,) int64, restart at 0 per sequence; (3, N) multimodal (Qwen2-VL)
    seq_id: torch.Tensor  # (N,) int64 packed-sequence index
    cu_seqlens: torch.Tensor  # (num_seqs + 1,) int64
    label_pos: torch.Tensor  # (A,) stream position of every action token
    label_step: torch.Tensor  # (A,) step (0..num_steps-1, in order) each action token belongs to
    label_mask: torch.Tensor  # (A,) bool, the step's action_mask
    num_steps: int
    step_value_pos: torch.Tensor  # (num_steps,) last observation token of each step
    act_index: torch.Tensor  # (A,) index of each action token in the batch's flat token arrays
    step_index: torch.Tensor  # (num_steps,) row of each step in the batch's step arrays
    bounds: list[tuple[int, int]]  # (start, end) of every sequence, as host ints
    trajectories: np.ndarray  # batch indices of the member trajectories
    cache: dict[str, Any] = field(default_factory=dict, repr=False)  # per-forward plans built once
    images: list[Any] = field(default_factory=list)  # the sequences' images, one per pad run in stream order
    image_pos: torch.Tensor | None = None  # (pads,) stream positions of the image pad tokens
    # context parallelism: this CP rank's share of a micro-batch (``context_parallel.shard``)
    cp: Any = None
    # shared prefixes (``LearnerBatch.micro_batches(share_prefix=...)``): per sequence the (start,
    # length) of the prefix rows it continues, (0, 0) for none; None: no sequence shares
    parents: list[tuple[int, int]] | None = None
    pred_pos: torch.Tensor | None = (
        None  # (A,) the row whose logits predict each action token (None: label_pos - 1)
    )

    @property
    def label_rows(self) -> torch.Tensor:
        """(A,) the rows whose logits predict the action tokens: the row before each one, or for a
        branch's first token the last row of the prefix it shares."""
        return self.label_pos - 1 if self.pred_pos is None else self.pred_pos

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    def unshared(self) -> tuple[torch.Tensor, list[tuple[int, int]], torch.Tensor]:
        """The micro-batch with every branch's shared prefix written out again in front of it: its
        tokens, sequence bounds and the action tokens' rows there (each sequence from position 0,
        as an engine prefills it)."""
        if self.parents is None:
            return self.tokens, self.bounds, self.label_pos
        rows, bounds, where = [], [], torch.empty(self.num_tokens, dtype=torch.long)
        n = 0
        for (a, e), (ps, pl) in zip(self.bounds, self.parents, strict=True):
            rows += [torch.arange(ps, ps + pl), torch.arange(a, e)]
            where[a:e] = torch.arange(n + pl, n + pl + e - a)
            bounds.append((n, n + pl + e - a))
            n += pl + e - a
        idx = torch.cat(rows).to(self.tokens.device)
        return self.tokens[idx], bounds, where.to(self.label_pos.device)[self.label_pos]

    def attention_mask(self) -> torch.Tensor:
        """(1, 1, N, N) bool, True = masked (Megatron's convention): block-diagonal causal, and a
        branch's rows see the prefix rows it shares."""
        n = self.num_tokens
        same = self.seq_id.view(n, 1) == self.seq_id.view(1, n)
        causal = torch.ones(n, n, dtype=torch.bool, device=self.tokens.device).tril()
        allowed = same & causal
        for (a, e), (ps, pl) in zip(self.bounds, self.parents or [], strict=False):
            if pl:
                allowed[a:e, ps : ps + pl] = True
        return ~allowed.view(1, 1, n, n)


def balanced_bins(lengths: list[int], count: int) -> list[list[int]]:
    """Indices of ``lengths`` in exactly ``count`` non-empty bins, the longest first into the
    least filled bin (expert parallelism needs the same number of micro-batches on every rank:
    each one's forward exchanges tokens with the other ranks)."""
    if not 1 <= count <= len(lengths):
        raise ValueError(f"{len(lengths)} trajectories cannot fill {count} micro-batches")
    order = sorted(range(len(lengths)), key=lambda k: -lengths[k])
    bins = [[i] for i in order[:count]]
    used = [lengths[i] for i in order[:count]]
    for i in order[count:]:
        b = min(range(count), key=used.__getitem__)
        bins[b].append(i)
        used[b] += lengths[i]
    return bins


def first_fit_decreasing(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices of ``lengths`` in bins of total <= ``budget`` (first-fit decreasing; an item longer
    than the budget gets a bin of its own). Attention is block-diagonal inside a micro-batch, so
    its cost grows with the micro-batch length squared: a budget of a few thousand tokens keeps
    it small."""
    if budget < 1:
        raise ValueError(f"micro-batch token budget must be >= 1, got {budget}")
    used: list[int] = []
    bins: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda k: -lengths[k]):
        for b, u in enumerate(used):
            if u + lengths[i] <= budget:
                used[b] += lengths[i]
                bins[b].append(i)
                break
        else:
            used.append(lengths[i])
            bins.append([i])
    return bins
