"""Step records -> packed token streams for the learner.

Prefix merging: when a step's observation starts with the previous step's observation + action
(``prefix_len`` covers both, as in append mode), the steps of a trajectory become ONE sequence
``obs_0 + act_0 + new_obs_1 + act_1 + ...``; a T-step trajectory then costs one forward over its
unique tokens instead of T re-prefills. A step whose observation was rewritten starts a new sequence.
Sequences are packed back to back without padding; positions restart per sequence and attention
is block-diagonal causal.

``per_step_rows`` builds the layout Agent-R1 and verl train on (one padded row per step), for the
benchmark and as the reference the packed logprobs are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Packed:
    tokens: torch.Tensor  # (N,) int64
    positions: torch.Tensor  # (N,) int64, restart at 0 per sequence
    seq_id: torch.Tensor  # (N,) int64 packed-sequence index
    cu_seqlens: torch.Tensor  # (num_seqs + 1,) int64
    label_pos: torch.Tensor  # (A,) positions in the stream of every action token (A = all actions)
    label_step: torch.Tensor  # (A,) which step (row of the input list) the action token belongs to
    label_mask: torch.Tensor  # (A,) bool, the step's action_mask
    num_steps: int
    step_value_pos: torch.Tensor | None = None  # (num_steps,) last observation token of each step

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    def attention_mask(self) -> torch.Tensor:
        """(1, 1, N, N) bool, True = masked (Megatron's convention): block-diagonal causal."""
        n = self.num_tokens
        same = self.seq_id.view(n, 1) == self.seq_id.view(1, n)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        return ~(same & causal).view(1, 1, n, n)


def merge_chains(steps: list[dict]) -> list[list[int]]:
    """Group the steps of ONE trajectory (in step order) into chains that share a prefix.
    Each step is ``{"obs": [...], "action": [...], "prefix_len": int}``."""
    chains: list[list[int]] = []
    prev_end = -1
    for i, s in enumerate(steps):
        if chains and s["prefix_len"] == prev_end and s["prefix_len"] > 0:
            chains[-1].append(i)
        else:
            chains.append([i])
        prev_end = len(s["obs"]) + len(s["action"])
    return chains


def pack(trajectories: list[list[dict]], merge: bool = True) -> Packed:
    """Pack trajectories (each a list of step dicts with obs, action, prefix_len, mask) into one
    stream. With ``merge=False`` every step is its own sequence (no prefix merging, no padding)."""
    toks: list[int] = []
    pos: list[int] = []
    seq: list[int] = []
    cu = [0]
    label_pos: list[int] = []
    label_step: list[int] = []
    label_mask: list[int] = []
    value_pos: list[int] = []
    row = 0
    for steps in trajectories:
        chains = merge_chains(steps) if merge else [[i] for i in range(len(steps))]
        for chain in chains:
            start = len(toks)
            for j, i in enumerate(chain):
                s = steps[i]
                new_obs = s["obs"] if j == 0 else s["obs"][s["prefix_len"] :]
                toks += new_obs
                a0 = len(toks)
                value_pos.append(a0 - 1)  # the critic's value at the step start
                toks += s["action"]
                label_pos += range(a0, len(toks))
                label_step += [row + i] * len(s["action"])
                label_mask += s.get("mask") or [1] * len(s["action"])
            n = len(toks) - start
            pos += range(n)
            seq += [len(cu) - 1] * n
            cu.append(len(toks))
        row += len(steps)
    t = torch.tensor
    return Packed(
        t(toks, dtype=torch.int64),
        t(pos, dtype=torch.int64),
        t(seq, dtype=torch.int64),
        t(cu, dtype=torch.int64),
        t(label_pos, dtype=torch.int64),
        t(label_step, dtype=torch.int64),
        t(label_mask, dtype=torch.bool),
        row,
        t(value_pos, dtype=torch.int64),
    )


def per_step_rows(trajectories: list[list[dict]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-step layout: (rows, max_len) token ids padded on the right, and (rows,) lengths."""
    seqs = [s["obs"] + s["action"] for steps in trajectories for s in steps]
    L = max(len(x) for x in seqs)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.int64)
    for i, x in enumerate(seqs):
        ids[i, : len(x)] = torch.tensor(x)
    return ids, torch.tensor([len(x) for x in seqs])


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, label_pos: torch.Tensor, chunk: int = 4096
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob and entropy of each label token from full-vocab ``logits`` (N, V) of a packed stream:
    the logits at position p - 1 predict the token at p. Computed in chunks of label tokens so a
    long stream never materialises a full (N, V) float32 log-softmax."""
    lps, ents = [], []
    for a in range(0, label_pos.numel(), chunk):
        p = label_pos[a : a + chunk]
        lg = logits[p - 1].float()
        logp = torch.log_softmax(lg, -1)
        lps.append(logp.gather(1, tokens[p].unsqueeze(1)).squeeze(1))
        ents.append(-(logp.exp() * logp).sum(-1))
    if not lps:
        z = logits.new_zeros(0, dtype=torch.float32)
        return z, z
    return torch.cat(lps), torch.cat(ents)


def merged_length(steps: list[dict]) -> int:
    """Tokens a trajectory costs after prefix merging."""
    n = 0
    for chain in merge_chains(steps):
        for j, i in enumerate(chain):
            s = steps[i]
            n += len(s["obs"] if j == 0 else s["obs"][s["prefix_len"] :]) + len(s["action"])
    return n


def pack_micro_batches(trajectories: list[list[dict]], max_tokens: int) -> list[tuple[list[int], Packed]]:
    """Split trajectories into micro-batches of at most ``max_tokens`` packed tokens (first-fit
    decreasing; a trajectory longer than the budget gets a micro-batch of its own). Attention is
    block-diagonal inside a micro-batch, so its cost grows with the micro-batch length squared:
    a budget of a few thousand tokens keeps it small. Returns (trajectory indices, Packed)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    lengths = [merged_length(t) for t in trajectories]
    bins: list[tuple[int, list[int]]] = []
    for i in sorted(range(len(trajectories)), key=lambda k: -lengths[k]):
        for b, (used, members) in enumerate(bins):
            if used + lengths[i] <= max_tokens:
                bins[b] = (used + lengths[i], members + [i])
                break
        else:
            bins.append((lengths[i], [i]))
    return [(sorted(m), pack([trajectories[i] for i in sorted(m)])) for _, m in bins]


def trajectories_from_records(records: list) -> list[list[dict]]:
    """StepRecords -> the learner's step dicts, grouped by trajectory (first appearance order),
    steps in ``step_index`` order."""
    out: dict[str, list] = {}
    for r in records:
        out.setdefault(r.trajectory_id, []).append(r)
    return [
        [
            {
                "obs": r.obs_token_ids,
                "action": r.action_token_ids,
                "prefix_len": r.prefix_len,
                "mask": r.action_mask,
            }
            for r in sorted(steps, key=lambda r: r.step_index)
        ]
        for steps in out.values()
    ]
