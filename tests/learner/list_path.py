"""The learner's update as it was before ``LearnerBatch`` (main at 8701c8b), frozen: step dicts and
Python lists, re-packed from the lists for every pass (old logprobs, reference, values, each
optimizer step), per-token lists turned into tensors per micro-batch.

Not used by training. It is the reference ``tests/learner/test_batch.py`` checks the columnar path
against (same losses, gradients and advantages on the same records) and the baseline of
``tools/bench/learner.py``. It drives the current ``Actor``/``Critic`` through their
schedule-level internals (``_run``, ``_update``, ``_logprobs``), which both paths share.
"""

from __future__ import annotations

import random

import numpy as np
import pyarrow as pa
import torch

from agent_r1.algos.advantages import ADVANTAGES, compute_advantages
from agent_r1.algos.losses import LossInputs, policy_loss
from agent_r1.algos.reduce import TorchReducer
from agent_r1.learner.packing import Packed
from agent_r1.learner.step_inputs import to_step_inputs
from agent_r1.records.schema import records_from_table


# ---- packing from lists ----------------------------------------------------------------------------
def trajectories_from_table(table: pa.Table) -> list[list[dict]]:
    """Records -> step dicts grouped by trajectory (first appearance), steps in index order."""
    out: dict[str, list] = {}
    for r in records_from_table(table):
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


def merge_chains(steps: list[dict]) -> list[list[int]]:
    chains: list[list[int]] = []
    prev_end = -1
    for i, s in enumerate(steps):
        if chains and s["prefix_len"] == prev_end and s["prefix_len"] > 0:
            chains[-1].append(i)
        else:
            chains.append([i])
        prev_end = len(s["obs"]) + len(s["action"])
    return chains


def pack(trajectories: list[list[dict]], merge: bool = True, members: list[int] | None = None) -> Packed:
    """One packed stream of the trajectories; ``label_step`` is the step's row in the input."""
    toks, pos, seq, cu = [], [], [], [0]
    label_pos, label_step, label_mask, value_pos = [], [], [], []
    row = 0
    for steps in trajectories:
        chains = merge_chains(steps) if merge else [[i] for i in range(len(steps))]
        for chain in chains:
            start = len(toks)
            for j, i in enumerate(chain):
                s = steps[i]
                toks += s["obs"] if j == 0 else s["obs"][s["prefix_len"] :]
                a0 = len(toks)
                value_pos.append(a0 - 1)
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
        tokens=t(toks, dtype=torch.int64),
        positions=t(pos, dtype=torch.int64),
        seq_id=t(seq, dtype=torch.int64),
        cu_seqlens=t(cu, dtype=torch.int64),
        label_pos=t(label_pos, dtype=torch.int64),
        label_step=t(label_step, dtype=torch.int64),
        label_mask=t(label_mask, dtype=torch.bool),
        num_steps=row,
        step_value_pos=t(value_pos, dtype=torch.int64),
        act_index=t(range(len(label_pos)), dtype=torch.int64),
        step_index=t(range(row), dtype=torch.int64),
        bounds=list(zip(cu[:-1], cu[1:], strict=True)),
        trajectories=np.array(members if members is not None else range(len(trajectories))),
    )


def merged_length(steps: list[dict]) -> int:
    n = 0
    for chain in merge_chains(steps):
        for j, i in enumerate(chain):
            s = steps[i]
            n += len(s["obs"] if j == 0 else s["obs"][s["prefix_len"] :]) + len(s["action"])
    return n


def pack_micro_batches(trajectories: list[list[dict]], max_tokens: int) -> list[Packed]:
    lengths = [merged_length(t) for t in trajectories]
    bins: list[tuple[int, list[int]]] = []
    for i in sorted(range(len(trajectories)), key=lambda k: -lengths[k]):
        for b, (used, members) in enumerate(bins):
            if used + lengths[i] <= max_tokens:
                bins[b] = (used + lengths[i], members + [i])
                break
        else:
            bins.append((lengths[i], [i]))
    return [pack([trajectories[i] for i in sorted(m)], members=sorted(m)) for _, m in bins]


def _global_rows(mb: Packed, trajectories: list[list[dict]], starts: list[int]) -> torch.Tensor:
    return torch.tensor(
        [starts[i] + k for i in mb.trajectories.tolist() for k in range(len(trajectories[i]))]
    )


def _logprobs(actor, mb: Packed, logits: torch.Tensor):
    """From the logits at every stream position (the old path projected all of them)."""
    from megatron.core import parallel_state as ps

    from agent_r1.learner.logprobs import packed_logprobs

    p = mb.label_pos
    v0 = ps.get_tensor_model_parallel_rank() * logits.shape[-1]
    group = ps.get_tensor_model_parallel_group()
    return packed_logprobs(logits[p - 1], mb.tokens[p], group, v0, actor.hf_config.vocab_size)


def _starts(trajectories: list[list[dict]]) -> list[int]:
    return np.cumsum([0] + [len(t) for t in trajectories])[:-1].tolist()


# ---- the actor and critic passes over lists -------------------------------------------------------
@torch.no_grad()
def logprobs(actor, trajectories: list[list[dict]]) -> list[list[float]] | None:
    from megatron.core import parallel_state as ps

    micro = pack_micro_batches(trajectories, actor.optim_cfg.micro_tokens)
    starts = _starts(trajectories)
    result: dict[int, list[float]] = {}

    def loss_fn(mb, logits):
        lp, _ = _logprobs(actor, mb, logits)
        rows = _global_rows(mb, trajectories, starts)
        out: dict[int, list[float]] = {int(r): [] for r in rows}
        for local, v in zip(mb.label_step.tolist(), lp.tolist(), strict=True):
            out[int(rows[local])].append(v)
        result.update(out)
        return lp.sum() * 0.0, {}

    actor._each("eval")
    actor._run(micro, loss_fn, forward_only=True, select_rows=False)
    return [result[i] for i in range(len(result))] if ps.is_pipeline_last_stage() else None


def values(critic, trajectories: list[list[dict]]) -> list[float] | None:
    from megatron.core import parallel_state as ps

    micro = pack_micro_batches(trajectories, critic.optim_cfg.micro_tokens)
    starts = _starts(trajectories)
    out: dict[int, float] = {}

    def loss_fn(mb, v):
        rows = _global_rows(mb, trajectories, starts).tolist()
        for row, val in zip(rows, v[mb.step_value_pos, 0].tolist(), strict=True):
            out[row] = val
        return v.sum() * 0.0, {}

    critic._each("eval")
    with torch.no_grad():
        critic._run(micro, loss_fn, forward_only=True, select_rows=False)
    return [out[i] for i in range(len(out))] if ps.is_pipeline_last_stage() else None


def train_step(
    actor, trajs, old, adv_step, loss_name, cfg, ref=None, rollout=None, teacher=None, adv_tok=None
):
    from megatron.core import parallel_state as ps

    micro = pack_micro_batches(trajs, actor.optim_cfg.micro_tokens)
    starts = _starts(trajs)
    n_tokens = sum(len(s["action"]) for t in trajs for s in t)
    n_steps = sum(len(t) for t in trajs)
    metrics: dict[str, float] = {}
    nmb = len(micro)

    def loss_fn(mb, logits):
        lp, ent = _logprobs(actor, mb, logits)
        rows = _global_rows(mb, trajs, starts)

        def per_token(lists):
            if lists is None:
                return None
            return torch.cat([torch.tensor(lists[r], dtype=torch.float32) for r in rows.tolist()])

        a = (
            per_token(adv_tok)
            if adv_tok is not None
            else torch.tensor(adv_step, dtype=torch.float32)[rows][mb.label_step]
        )
        x = LossInputs(
            lp, per_token(old), a, mb.label_mask, mb.label_step, mb.num_steps,
            ref_logprobs=per_token(ref), rollout_logprobs=per_token(rollout), entropy=ent,
            teacher_logprobs=per_token(teacher),
        )  # fmt: skip
        agg = cfg.agg  # resolved by the config (a loss's forced aggregation included)
        loss, m = policy_loss(
            loss_name, x, cfg, denom=float(n_tokens) if agg == "token-mean" else float(n_steps)
        )
        for k, v in m.items():
            metrics[k] = metrics.get(k, 0.0) + (v if k.startswith("loss/") else v / nmb)
        return loss * nmb, {}

    metrics.update(actor._update(micro, loss_fn, select_rows=False))
    if not ps.is_pipeline_last_stage():
        return {"grad_norm": metrics["grad_norm"], "lr": metrics["lr"]}
    return metrics


def critic_step(critic, trajs, returns, old_values) -> dict[str, float]:
    micro = pack_micro_batches(trajs, critic.optim_cfg.micro_tokens)
    starts = _starts(trajs)
    n_steps = sum(len(t) for t in trajs)
    nmb = len(micro)
    metrics = {"value_loss": 0.0}

    def loss_fn(mb, v):
        rows = _global_rows(mb, trajs, starts)
        v = v[mb.step_value_pos, 0].float()
        r = torch.tensor(returns, dtype=torch.float32)[rows]
        loss = (v - r) ** 2
        if critic.value_clip is not None and old_values is not None:
            o = torch.tensor(old_values, dtype=torch.float32)[rows]
            loss = torch.maximum(loss, (o + (v - o).clamp(-critic.value_clip, critic.value_clip) - r) ** 2)
        loss = 0.5 * loss.sum() / n_steps
        metrics["value_loss"] += float(loss.detach())
        return loss * nmb, {}

    metrics.update(critic._update(micro, loss_fn, select_rows=False))
    return metrics


# ---- the update ------------------------------------------------------------------------------------
def update(learner, table: pa.Table, version: int, iteration: int) -> dict[str, float]:
    """``Learner.update`` as it was: old/ref logprobs and values over lists, advantages through
    lists, every mini-batch re-packed from the step dicts."""
    import torch.distributed as dist

    a = learner.cfg.algorithm
    est = ADVANTAGES.get(a.advantage)
    batch = to_step_inputs(table, a.process_coef, tokens=est.level == "token", anchors="anchor" in est.needs)
    records = records_from_table(batch.table)
    trajs = trajectories_from_table(batch.table)
    rollout = [list(r.action_logprobs) for r in records]
    versions = [r.policy_version for r in records]
    old = logprobs(learner.actor, trajs)
    ref = logprobs(learner.ref, trajs) if learner.ref is not None else None
    vals = values(learner.critic, trajs) if learner.critic is not None else None
    metrics: dict[str, float] = {}
    adv_step = adv_tok = returns = teacher = None
    if learner.last_stage:
        if vals is not None:
            batch.inputs.value = torch.tensor(vals, dtype=torch.float64)
            if est.level == "token":
                batch.inputs.tokens.values = torch.tensor(
                    [v for v, t in zip(vals, rollout, strict=True) for _ in t], dtype=torch.float64
                )
        adv = compute_advantages(a.advantage, batch.inputs, a.estimator, TorchReducer(learner.dp_group))
        metrics.update({f"adv/{k}": v for k, v in adv.metrics.items()})
        lengths = [len(x) for x in rollout]
        if adv.token_adv is not None:
            flat, adv_tok, i = adv.token_adv.float().tolist(), [], 0
            for n in lengths:
                adv_tok.append(flat[i : i + n])
                i += n
        else:
            adv_step = adv.step_adv.float().tolist()
            metrics["adv/mean"] = float(np.mean(adv_step)) if adv_step else 0.0
        if "teacher_logprobs" in batch.table.column_names:
            teacher = batch.table.column("teacher_logprobs").to_pylist()
        returns = adv.step_ret.tolist() if adv.step_ret is not None else None
        diffs = [
            abs(o - r) for os_, rs in zip(old, rollout, strict=True) for o, r in zip(os_, rs, strict=True)
        ]
        metrics["mismatch/abs_logprob_diff_rollout_learner"] = float(np.mean(diffs)) if diffs else 0.0
        metrics["staleness/max"] = float(version - min(versions)) if versions else 0.0
    t = torch.tensor([min(a.mini_batches, max(len(trajs), 1))])
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    k = int(t)
    offsets = np.cumsum([0] + [len(x) for x in trajs])
    rng = random.Random(learner.cfg.trainer.seed * 1_000_003 + iteration)
    step_metrics = []
    for epoch in range(a.epochs):
        order = list(range(len(trajs)))
        if epoch:
            rng.shuffle(order)
        bounds = np.linspace(0, len(order), k + 1).round().astype(int)
        for c in range(k):
            sel = order[bounds[c] : bounds[c + 1]]
            steps = [s for i in sel for s in range(offsets[i], offsets[i + 1])]

            def pick(xs, steps=steps):
                return None if xs is None else [xs[s] for s in steps]

            mb_trajs = [trajs[i] for i in sel]
            m = train_step(
                learner.actor, mb_trajs, pick(old) or [[0.0] * len(x) for x in pick(rollout)],
                pick(adv_step) or [0.0] * len(steps), a.loss, a.policy, ref=pick(ref), rollout=pick(rollout),
                teacher=pick(teacher), adv_tok=pick(adv_tok),
            )  # fmt: skip
            if learner.critic is not None:
                crit = critic_step(learner.critic, mb_trajs, pick(returns), pick(vals))
                m.update({f"critic/{kk}": vv for kk, vv in crit.items()})
            step_metrics.append(m)
    keys = {kk for m in step_metrics for kk in m}
    metrics.update({kk: float(np.mean([m[kk] for m in step_metrics if kk in m])) for kk in sorted(keys)})
    metrics["train/optimizer_steps"] = float(len(step_metrics))
    metrics["train/tokens"] = float(
        sum(len(s["obs"]) - s["prefix_len"] + len(s["action"]) for t in trajs for s in t)
    )
    return metrics
