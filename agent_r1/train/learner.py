"""Learner role: one rank's policy (and critic / reference) and the update on an iteration's records.

Every learner rank runs ``Learner.update`` on its data-parallel share of the records (whole groups,
read straight from the shards); advantages are computed with group statistics reduced over the
data-parallel group, then the configured loss runs over mini-batches and epochs.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import torch
import torch.distributed as dist
from tqdm import tqdm

from agent_r1.train.config import TrainConfig, bridge_config

log = logging.getLogger("agent_r1.learner")


@dataclass
class Prepared:
    """One rank's share of an iteration, in the learner's step order."""

    trajectories: list[list[dict]]
    rollout_logprobs: list[list[float]]
    versions: list[int]  # policy version of each step
    table: pa.Table  # in step order
    batch: Any  # records.batch.StepBatch: the advantage estimators' flat inputs, same order


def prepare(
    table: pa.Table, process_coef: float = 1.0, tokens: bool = False, anchors: bool = False
) -> Prepared:
    """Order the records by trajectory and step once: the learner's trajectories and the flat
    advantage inputs (``to_step_inputs`` with these options) come from the same pass."""
    from agent_r1.learner.packing import trajectories_from_records
    from agent_r1.records.batch import to_step_inputs
    from agent_r1.records.schema import records_from_table

    batch = to_step_inputs(table, process_coef, tokens=tokens, anchors=anchors)
    records = records_from_table(batch.table)
    return Prepared(
        trajectories_from_records(records),
        [list(r.action_logprobs) for r in records],
        [r.policy_version for r in records],
        batch.table,
        batch,
    )


def _chunks(n: int, k: int) -> list[range]:
    """``k`` contiguous, near-equal ranges over ``n`` items."""
    bounds = np.linspace(0, n, k + 1).round().astype(int)
    return [range(bounds[i], bounds[i + 1]) for i in range(k)]


def _mean_metrics(ms: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for m in ms for k in m}
    return {k: float(np.mean([m[k] for m in ms if k in m])) for k in sorted(keys)}


class Learner:
    def __init__(self, cfg: TrainConfig):
        from megatron.core import parallel_state as ps

        from agent_r1.learner.actor import Actor
        from agent_r1.learner.critic import Critic

        self.cfg, self.ps = cfg, ps
        bridge = bridge_config(cfg)
        seed = cfg.trainer.seed
        self.actor = Actor(cfg.model.path, bridge, cfg.optim.build(), seed=seed)
        self.critic = None
        if cfg.algorithm.critic:
            copt = dataclasses.replace(cfg.optim.build(), lr=cfg.algorithm.critic_lr)
            self.critic = Critic(cfg.model.path, bridge, copt, seed=seed)
        self.ref = (
            Actor(cfg.model.path, bridge, cfg.optim.build(), seed=seed, trainable=False)
            if cfg.algorithm.reference
            else None
        )

    # ---- data-parallel layout -------------------------------------------------------------------
    @property
    def dp(self) -> tuple[int, int, Any]:
        ps = self.ps
        return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), ps.get_data_parallel_group()

    @property
    def last_stage(self) -> bool:
        return self.ps.is_pipeline_last_stage()

    def read(self, records_dir, iteration: int) -> pa.Table:
        from agent_r1.records.reader import RecordStore

        rank, world, _ = self.dp
        return RecordStore(records_dir).read(iteration, rank, world, by="group")

    def _agree_min(self, n: int) -> int:
        t = torch.tensor([n], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    # ---- the update ------------------------------------------------------------------------------
    def update(self, table: pa.Table, version: int, iteration: int) -> dict[str, float]:
        """Old/ref logprobs and values, advantages, then epochs x mini-batches of the loss."""
        from agent_r1.algos.advantages import ADVANTAGES, compute_advantages
        from agent_r1.algos.reduce import TorchReducer
        from agent_r1.learner.actor import StepBatchForLearner

        a = self.cfg.algorithm
        est = ADVANTAGES.get(a.advantage)
        p = prepare(table, a.process_coef, tokens=est.level == "token", anchors="anchor" in est.needs)
        trajs = p.trajectories
        old = self.actor.logprobs(trajs)
        ref = self.ref.logprobs(trajs) if self.ref is not None else None
        values = self.critic.values(trajs) if self.critic is not None else None
        metrics: dict[str, float] = {}
        adv_step = adv_tok = None
        teacher = None
        if self.last_stage:
            batch = p.batch
            if values is not None:
                batch.inputs.value = torch.tensor(values, dtype=torch.float64)
                if est.level == "token":  # a step's value for each of its tokens
                    per_tok = [v for v, t in zip(values, p.rollout_logprobs, strict=True) for _ in t]
                    batch.inputs.tokens.values = torch.tensor(per_tok, dtype=torch.float64)
            _, _, group = self.dp
            adv = compute_advantages(a.advantage, batch.inputs, a.estimator, TorchReducer(group))
            metrics.update({f"adv/{k}": v for k, v in adv.metrics.items()})
            lengths = [len(x) for x in p.rollout_logprobs]
            if adv.token_adv is not None:
                adv_tok = _split(adv.token_adv.float().tolist(), lengths)
            else:
                adv_step = adv.step_adv.float().tolist()
                metrics["adv/mean"] = float(np.mean(adv_step)) if adv_step else 0.0
            if "teacher_logprobs" in p.table.column_names:
                teacher = p.table.column("teacher_logprobs").to_pylist()
            returns = adv.step_ret.tolist() if adv.step_ret is not None else None
            diffs = [
                abs(o - r)
                for os_, rs in zip(old, p.rollout_logprobs, strict=True)
                for o, r in zip(os_, rs, strict=True)
            ]
            metrics["mismatch/abs_logprob_diff_rollout_learner"] = float(np.mean(diffs)) if diffs else 0.0
            metrics["staleness/max"] = float(version - min(p.versions)) if p.versions else 0.0
            metrics["staleness/mean"] = float(version - np.mean(p.versions)) if p.versions else 0.0
        else:
            returns = None
        # every rank takes the same number of optimizer steps (the update is collective)
        k = self._agree_min(min(a.mini_batches, max(len(trajs), 1)))
        if len(trajs) == 0:
            raise RuntimeError(f"iteration {iteration}: this learner rank got no trajectories")
        offsets = np.cumsum([0] + [len(t) for t in trajs])
        rng = random.Random(self.cfg.trainer.seed * 1_000_003 + iteration)
        step_metrics = []
        bar = tqdm(
            total=a.epochs * k,
            desc=f"train {iteration}",
            unit="step",
            leave=False,
            disable=not (self.cfg.trainer.progress and dist.get_rank() == 0),
        )
        for epoch in range(a.epochs):
            order = list(range(len(trajs)))
            if epoch:
                rng.shuffle(order)
            for chunk in _chunks(len(order), k):
                sel = [order[i] for i in chunk]
                steps = [s for i in sel for s in range(offsets[i], offsets[i + 1])]

                def pick(xs, steps=steps):
                    return None if xs is None else [xs[s] for s in steps]

                mb = StepBatchForLearner(
                    [trajs[i] for i in sel],
                    pick(old) or [[0.0] * len(x) for x in pick(p.rollout_logprobs)],
                    pick(adv_step) or [0.0] * len(steps),
                    ref_logprobs=pick(ref),
                    rollout_logprobs=pick(p.rollout_logprobs),
                    teacher_logprobs=pick(teacher),
                    token_advantages=pick(adv_tok),
                )
                m = self.actor.train_step(mb, a.loss, a.policy)
                if self.critic is not None:
                    old_v = pick(values)
                    crit = self.critic.train_step(mb.trajectories, pick(returns), old_v)
                    m.update({f"critic/{kk}": vv for kk, vv in crit.items()})
                step_metrics.append(m)
                bar.update(1)
        bar.close()
        metrics.update(_mean_metrics(step_metrics))
        metrics["train/optimizer_steps"] = float(len(step_metrics))
        metrics["train/tokens"] = float(
            sum(len(s["obs"]) - s["prefix_len"] + len(s["action"]) for t in trajs for s in t)
        )
        return metrics

    def sft(
        self,
        trajs: list[list[dict]],
        steps: int,
        batch: int,
        seed: int,
        progress: bool,
        stop: Callable[[], bool] | None = None,
    ) -> list[float] | None:
        """Warm start: ``steps`` optimizer steps of -log pi on demonstrated actions; None when
        ``stop()`` (a collective, asked every 20 steps) says a stop was requested."""
        from agent_r1.algos.losses import loss_config
        from agent_r1.learner.actor import StepBatchForLearner

        rng = random.Random(seed)
        losses = []
        c = self.cfg.sft
        sft = dataclasses.replace(
            self.actor.optim_cfg,
            lr=c.lr,
            min_lr=c.lr if c.min_lr is None else c.min_lr,
            warmup_steps=min(c.warmup_steps, steps),
            decay_steps=steps,
        )
        self.actor.scheduler = self.actor.make_scheduler(sft)
        bar = tqdm(range(steps), desc="warm start (SFT)", unit="step", disable=not progress, leave=False)
        for step in bar:
            if stop is not None and step % 20 == 0 and stop():
                bar.close()
                return None
            sel = rng.sample(range(len(trajs)), min(batch, len(trajs)))
            tb = [trajs[i] for i in sel]
            zeros = [[0.0] * len(s["action"]) for t in tb for s in t]
            m = self.actor.train_step(
                StepBatchForLearner(tb, zeros, [0.0] * len(zeros)), "sft", loss_config("sft")
            )
            if "loss/pg" in m:
                losses.append(m["loss/pg"])
                bar.set_postfix(nll=f"{m['loss/pg']:.3f}")
        self.actor.scheduler = self.actor.make_scheduler(self.actor.optim_cfg)  # back to the RL schedule
        return losses

    # ---- weights ---------------------------------------------------------------------------------
    def gather_hf_weights(self) -> dict[str, torch.Tensor] | None:
        """Full HF-named weights on global rank 0 (pipeline stages gathered); None elsewhere."""
        ps = self.ps
        named = dict(self.actor.export_hf())
        if ps.get_pipeline_model_parallel_world_size() == 1:
            return named if dist.get_rank() == 0 else None
        mine = named if ps.get_data_parallel_rank() == 0 and ps.get_tensor_model_parallel_rank() == 0 else {}
        parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, parts, dst=0)
        if dist.get_rank() != 0:
            return None
        out: dict[str, torch.Tensor] = {}
        for part in parts:
            out.update(part)
        return out

    # ---- checkpoints -----------------------------------------------------------------------------
    def save(self, path, trainer_state: dict[str, Any]) -> None:
        if self.critic is not None:  # first: the actor's directory is what marks a checkpoint complete
            self.critic.save(path.with_name(path.name + ".critic"), {})
        self.actor.save(path, trainer_state)

    def load(self, path) -> dict[str, Any]:
        state = self.actor.load(path)
        if self.critic is not None:
            self.critic.load(path.with_name(path.name + ".critic"))
        return state


def _split(flat: list[float], lengths: list[int]) -> list[list[float]]:
    out, i = [], 0
    for n in lengths:
        out.append(flat[i : i + n])
        i += n
    return out
