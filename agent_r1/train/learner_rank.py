"""Learner role: one rank's policy (and critic / reference) and the update on an iteration's records.

Every learner rank runs ``Learner.update`` on its data-parallel share of the records (whole groups,
read straight from the shards) as one ``LearnerBatch``; advantages are computed with group
statistics reduced over the data-parallel group, then the configured loss runs over mini-batches
and epochs. The loss is a data-parallel-global mean: its denominator counts the trainable tokens
(or steps) of the mini-batch on every rank.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import torch
import torch.distributed as dist

from agent_r1.algos.advantages import ADVANTAGES, compute_advantages
from agent_r1.algos.losses import loss_config
from agent_r1.algos.step_rewards import RunningReturnStd
from agent_r1.learner.actor import Actor
from agent_r1.learner.actor_steps import PolicyTargets
from agent_r1.learner.backend import Backend, keep_freed_host_memory
from agent_r1.learner.batch import LearnerBatch, drop_nonfinite
from agent_r1.learner.critic import Critic
from agent_r1.learner.optim import pad_multiple
from agent_r1.logging import Progress
from agent_r1.records.reader import RecordStore
from agent_r1.rollout.protocol import logprob_temperature
from agent_r1.train.config import TrainConfig, bridge_config
from agent_r1.train.learner_state import LearnerState
from agent_r1.vision.qwen2_vl import Geometry

log = logging.getLogger("agent_r1.learner")


def _chunks(n: int, k: int) -> list[range]:
    """``k`` contiguous, near-equal ranges over ``n`` items."""
    bounds = np.linspace(0, n, k + 1).round().astype(int)
    return [range(bounds[i], bounds[i + 1]) for i in range(k)]


def _mean_metrics(ms: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for m in ms for k in m}
    return {k: float(np.mean([m[k] for m in ms if k in m])) for k in sorted(keys)}


class Learner(LearnerState):
    def __init__(self, cfg: TrainConfig, backend: Backend | None = None):
        """``backend``: what this rank runs on (``Backend.here()``; ``agent-r1 plan`` passes its
        dry run's)."""
        from megatron.core import parallel_state as ps

        self.cfg, self.ps = cfg, ps
        self.backend = backend = backend or Backend.here()
        keep_freed_host_memory()  # a CPU learner reuses its step's large blocks (no page faults)
        bridge = bridge_config(cfg)
        seed = cfg.trainer.seed
        temp = logprob_temperature(cfg.episode.temperature)  # the rollout's logprobs are tempered
        adapt = not cfg.trainer.deterministic  # fixed thread counts: the same reductions every step
        values = None
        if cfg.trainer.deterministic:  # true on-policy: logprob values the engine's bits
            from agent_r1.engines.embedded.scorer import Scorer

            values = Scorer(cfg.model.path, cfg.model.dtype, temp)
        self.actor = Actor(
            cfg.model.path,
            bridge,
            cfg.optim,
            seed=seed,
            train_vision=cfg.model.train_vision,
            temperature=temp,
            backend=backend,
            adapt_threads=adapt,
            logprob_values=values,
        )
        self.vision = Geometry.of(cfg.model.path)  # None: a text-only model
        moe = self.actor.module.config if self.actor.router_stats is not None else None
        if moe is not None and dist.get_rank() == 0:
            log.info(
                "mixture of experts: %d experts, top %d, load-balancing loss coefficient %g (the HF "
                "config's router_aux_loss_coef), no z-loss; EP %d",
                moe.num_moe_experts, moe.moe_router_topk, moe.moe_aux_loss_coeff, cfg.parallel.ep,
            )  # fmt: skip
        self.device = self.actor.device
        self.critic = None
        if cfg.algorithm.critic:
            copt = dataclasses.replace(cfg.optim, lr=cfg.algorithm.critic_lr)
            self.critic = Critic(
                cfg.model.path, bridge, copt, seed=seed, backend=backend, adapt_threads=adapt
            )
        self.ref = (
            Actor(
                cfg.model.path,
                bridge,
                cfg.optim,
                seed=seed,
                trainable=False,
                temperature=temp,
                backend=backend,
                adapt_threads=adapt,
            )
            if cfg.algorithm.reference
            else None
        )
        self.dropped = 0  # trajectories of the last read with non-finite logprobs or rewards
        # PSPO's optional reward scaling; its running moments are part of the trainer state
        a = cfg.algorithm
        self.reward_scaler = RunningReturnStd(gamma=a.estimator.gamma) if a.reward_scaling else None

    # ---- data-parallel layout -------------------------------------------------------------------
    @property
    def dp_group(self) -> Any:
        return self.ps.get_data_parallel_group()

    @property
    def last_stage(self) -> bool:
        return self.ps.is_pipeline_last_stage()

    def read(self, records_dir, iteration: int) -> pa.Table:

        ps = self.ps
        rank, world = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        table = RecordStore(records_dir).read(iteration, rank, world, by="group")
        table, self.dropped = drop_nonfinite(table)
        if self.dropped:
            log.warning(
                "iteration %d: %d trajectories with non-finite logprobs or rewards are not trained on",
                iteration,
                self.dropped,
            )
            if table.num_rows == 0:
                raise RuntimeError(
                    f"every record of iteration {iteration} in {records_dir} (data-parallel rank "
                    f"{rank}) has non-finite logprobs or rewards: the rollout servers' weights are broken"
                )
        return table

    def batch(self, table: pa.Table) -> LearnerBatch:
        """The iteration's records as the flat batch the update indexes into."""
        a = self.cfg.algorithm
        est = ADVANTAGES.get(a.advantage)
        return LearnerBatch.from_table(
            table,
            self.device,
            a.process_coef,
            tokens=est.level == "token",
            anchors="anchor" in est.needs,
            vision=self.vision,
        )

    def micro(self, b: LearnerBatch, trajectories: np.ndarray | None = None, cache: bool = True):
        """The selection's micro-batches; with expert parallelism as many on every data-parallel
        rank (each forward of an MoE layer exchanges tokens with the other EP ranks: a rank with
        fewer would leave them waiting), a collective then; with virtual pipeline stages a
        multiple of pp of them (the interleaved schedule runs them in groups of pp)."""
        par = self.cfg.parallel
        pad_to = pad_multiple(self.cfg.optim, self.cfg.model.precision, par.tp if par.sp else 1)
        share = self.cfg.optim.share_prefix
        micro = b.micro_batches(
            trajectories, self.cfg.optim.micro_tokens, cache=cache, pad_to=pad_to, share_prefix=share
        )
        count = len(micro)
        if par.ep > 1:
            count = int(self.backend.all_reduce_scalar(count, "max", group=self.dp_group, dtype=torch.int64))
        if par.vpp > 1:
            count = -(-count // par.pp) * par.pp
        if count == len(micro):
            return micro
        have = b.num_trajectories if trajectories is None else len(trajectories)
        if count > have:
            raise ValueError(
                f"parallel.vpp={par.vpp}: the interleaved schedule needs micro-batches in groups of "
                f"parallel.pp={par.pp}, and this learner rank has {have} trajectories for {count}: "
                "raise rollout.batch_size (or lower algorithm.mini_batches)"
            )
        return b.micro_batches(
            trajectories,
            self.cfg.optim.micro_tokens,
            cache=cache,
            pad_to=pad_to,
            count=count,
            share_prefix=share,
        )

    def _plan(self, n: int, iteration: int) -> list[np.ndarray]:
        """The trajectories of every optimizer step: epochs x mini-batches (the same number on
        every rank: the update is collective); epochs after the first reshuffle."""
        a = self.cfg.algorithm
        k = int(self.backend.all_reduce_scalar(min(a.mini_batches, max(n, 1)), "min", dtype=torch.int64))
        if n == 0:
            raise RuntimeError(f"iteration {iteration}: this learner rank got no trajectories")
        rng = random.Random(self.cfg.trainer.seed * 1_000_003 + iteration)
        plan = []
        for epoch in range(a.epochs):
            order = list(range(n))
            if epoch:
                rng.shuffle(order)
            plan += [np.array([order[i] for i in chunk], dtype=np.int64) for chunk in _chunks(n, k)]
        return plan

    def _denominators(self, b: LearnerBatch, sel: np.ndarray, agg: str) -> tuple[float, float]:
        """This rank's shares (global count / data-parallel ranks; DDP averages gradients) of
        the policy loss denominator (tokens with mask 1, or steps with at least one) and of the
        value loss denominator (steps), over the mini-batch on every data-parallel rank."""
        trainable = b.trainable_per_step[b.steps_of(sel)]
        counts = torch.tensor(
            [trainable.sum(), (trainable > 0).sum(), len(trainable)],
            dtype=torch.float64,
            device=self.backend.collective_device(self.dp_group),
        )
        dist.all_reduce(counts, group=self.dp_group)
        share = counts / self.ps.get_data_parallel_world_size()
        return float(share[0] if agg == "token-mean" else share[1]), float(share[2])

    def _advantages(self, b: LearnerBatch, values: torch.Tensor | None):
        """Advantages and returns from the batch's step inputs (host, float64; group statistics
        over the data-parallel group): (A,) float32 per-token advantages on the device, (S,)
        step returns (or None), metrics."""
        a = self.cfg.algorithm
        inputs = b.inputs
        metrics: dict[str, float] = {}
        if self.reward_scaler is not None:  # r / running std of discounted step returns (over DP)
            inputs.reward = self.reward_scaler.scale(
                inputs.reward, inputs.traj, self.backend.reducer(self.dp_group)
            )
            s = self.reward_scaler
            metrics["reward/scaling_std"] = (s.m2 / s.count) ** 0.5 if s.count else 0.0
        if values is not None:
            inputs.value = values.to("cpu", torch.float64)
            if inputs.tokens is not None:  # token-level estimators: a step's value for each of its tokens
                inputs.tokens.values = b.per_token(values).to("cpu", torch.float64)
        adv = compute_advantages(a.advantage, inputs, a.estimator, self.backend.reducer(self.dp_group))
        metrics.update({f"adv/{k}": v for k, v in adv.metrics.items()})
        if adv.token_adv is not None:
            per_token = adv.token_adv.to(self.device, torch.float32)
        else:
            metrics["adv/mean"] = float(adv.step_adv.mean()) if adv.step_adv.numel() else 0.0
            per_token = b.per_token(adv.step_adv.to(self.device, torch.float32))
        returns = None
        if adv.step_ret is not None:
            returns = adv.step_ret.to(self.device, torch.float32)
        elif values is not None:  # token-level GAE: the critic's target at a step start is the
            # return at the step's first action token (a step without tokens keeps its value)
            first = torch.from_numpy(b.act_offsets[:-1]).to(self.device)
            has = torch.from_numpy(np.diff(b.act_offsets) > 0).to(self.device)
            token_ret = adv.token_ret.to(self.device, torch.float32)
            returns = torch.where(has, token_ret[first.clamp(max=max(len(token_ret) - 1, 0))], values)
        return per_token, returns, metrics

    # ---- the update ------------------------------------------------------------------------------
    def update(self, table: pa.Table, version: int, iteration: int) -> dict[str, float]:
        """Old/ref logprobs and values, advantages, then epochs x mini-batches of the loss."""
        a = self.cfg.algorithm
        b = self.batch(table)
        plan = self._plan(b.num_trajectories, iteration)
        # The first optimizer step runs before any weight has moved, so its own forward gives the
        # old logprobs of its trajectories; only the others need an old-logprob pass beforehand.
        later = np.setdiff1d(np.arange(b.num_trajectories), plan[0])
        old = self.actor.logprobs(self.micro(b, later), b.num_action_tokens) if later.size else None
        ref = self.ref.logprobs(self.micro(b), b.num_action_tokens) if self.ref is not None else None
        values = self.critic.values(self.micro(b), b.num_steps) if self.critic is not None else None
        metrics, targets, returns = {}, None, None
        if self.last_stage:
            adv, returns, metrics = self._advantages(b, values)
            targets = PolicyTargets(adv, None, ref, b.rollout_logprobs, b.teacher_logprobs)
        agg = a.policy.agg
        step_metrics = []
        show = self.cfg.trainer.progress and dist.get_rank() == 0
        for i, sel in enumerate(Progress(plan, desc=f"train {iteration}", unit="step", enabled=show)):
            micro = self.micro(b, sel)
            denom, value_denom = self._denominators(b, sel, agg)
            m, lp = self.actor.train_step(micro, targets, a.loss, a.policy, denom)
            if i == 0 and targets is not None:  # the old logprobs of the first step's trajectories
                old = lp if old is None else torch.where(torch.isnan(lp), old, lp)
                targets.old_logprobs = old
            if self.critic is not None:
                crit = self.critic.train_step(micro, returns, values, value_denom)
                m.update({f"critic/{k}": v for k, v in crit.items()})
            step_metrics.append(m)
        metrics.update(_mean_metrics(step_metrics))
        if self.last_stage:
            metrics.update(_rollout_metrics(b, old, version))
        metrics["train/optimizer_steps"] = float(len(step_metrics))
        metrics["data/nonfinite_trajectories"] = self.backend.all_reduce_scalar(
            self.dropped, "sum", self.dp_group
        )
        metrics["train/tokens"] = float(b.num_stream_tokens)
        if self.actor.router_stats is not None:  # a mixture of experts: where the routers sent tokens
            metrics.update(self.actor.router_stats.report(self.ps.get_tensor_model_parallel_world_size()))
        return self._from_last_stage(metrics)

    def _from_last_stage(self, x: Any) -> Any:
        """What the last pipeline stage computed (losses, advantages, values live there), on every
        stage of the pipeline: rank 0, the coordinator, reports it."""
        ps = self.ps
        if ps.get_pipeline_model_parallel_world_size() == 1:
            return x
        group = ps.get_pipeline_model_parallel_group()
        parts = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, x, group=group)
        if isinstance(x, dict):  # stage order: the last stage's values win, other stages add theirs
            return {k: v for part in parts for k, v in part.items()}
        return parts[-1]

    def sft(
        self,
        b: LearnerBatch,
        steps: int,
        batch: int,
        seed: int,
        progress: bool,
        stop: Callable[[], bool] | None = None,
    ) -> list[float] | None:
        """Warm start: ``steps`` optimizer steps of -log pi on demonstrated actions; None when
        ``stop()`` (a collective, asked every 20 steps) says a stop was requested."""
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
        targets = PolicyTargets(torch.zeros(b.num_action_tokens, device=self.device))
        nll = loss_config("sft")
        bar = Progress(range(steps), desc="warm start (SFT)", unit="step", enabled=progress)
        for step in bar:
            if stop is not None and step % 20 == 0 and stop():
                bar.close()
                return None
            sel = np.array(rng.sample(range(b.num_trajectories), min(batch, b.num_trajectories)))
            denom, _ = self._denominators(b, sel, "token-mean")
            m, _ = self.actor.train_step(self.micro(b, sel, cache=False), targets, "sft", nll, denom)
            if "loss/pg" in m:
                losses.append(m["loss/pg"])
                bar.set_postfix(nll=f"{m['loss/pg']:.3f}")
        self.actor.scheduler = self.actor.make_scheduler(self.actor.optim_cfg)  # back to the RL schedule
        return self._from_last_stage(losses)


def _rollout_metrics(b: LearnerBatch, old: torch.Tensor, version: int) -> dict[str, float]:
    """Learner-vs-rollout |logprob difference| over every action token (its mean, its max, the
    share of tokens whose two logprobs are the same float32 bits), and staleness."""
    diff = (old - b.rollout_logprobs).abs()
    return {
        "mismatch/abs_logprob_diff_rollout_learner": float(diff.mean()) if diff.numel() else 0.0,
        "mismatch/max_abs_logprob_diff": float(diff.max()) if diff.numel() else 0.0,
        "mismatch/bitwise_equal_fraction": float((diff == 0).float().mean()) if diff.numel() else 1.0,
        "staleness/max": float(version - b.versions.min()) if b.versions.size else 0.0,
        "staleness/mean": float(version - b.versions.mean()) if b.versions.size else 0.0,
        # the share of trained steps generated by an older policy than the one training on them
        "staleness/stale_fraction": float((b.versions < version).mean()) if b.versions.size else 0.0,
    }
