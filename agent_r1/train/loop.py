"""The RL loop, run by every learner rank; rank 0 (the coordinator) also drives the rollout side.

resume or warm start -> push weights -> evaluate
for each iteration:
    records  <- rollout task (prompts from the data cursor; prefetched in async mode)
    update   <- old/ref logprobs, values, distributed advantages, loss over mini-batches
    push weights to the rollout servers, note what was consumed in the ledger
    evaluate every K, checkpoint every M, report
summary.json
"""

from __future__ import annotations

import logging
import signal
import time
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from agent_r1.agent.chat import ChatCodec
from agent_r1.learner.backend.cpu_compat import apply
from agent_r1.learner.checkpoint_files import CheckpointError, first_nonfinite
from agent_r1.records.shard import iteration_dirs
from agent_r1.train.config import TrainConfig
from agent_r1.train.coordinator import (
    Coordinator,
    checkpoint_candidates,
    checkpoint_path,
    remove_partial_checkpoints,
)
from agent_r1.train.learner_rank import Learner
from agent_r1.train.metrics import Reporter, console_line, rollout_scalars, sample_text
from agent_r1.train.run_dir import RunDir, atomic_write_json
from agent_r1.train.tasks import StopRequested
from agent_r1.train.warm_start import WarmStart

log = logging.getLogger("agent_r1.train")

# set by SIGTERM / SIGUSR1 (Slurm's warning before preemption or time limit) / SIGINT (Ctrl-C)
_STOP = {"signal": None}


def _on_signal(signum, frame) -> None:  # noqa: ARG001
    _STOP["signal"] = signum


def install_signal_handlers() -> None:
    for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(s, _on_signal)


@contextmanager
def _timed(times: dict[str, float], key: str):
    t0 = time.time()
    try:
        yield
    finally:
        times[key] = time.time() - t0


def _bcast(obj: Any) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class Trainer(WarmStart):
    def __init__(self, cfg: TrainConfig, rd: RunDir, alive: Any = None):
        self.cfg, self.rd = cfg, rd
        self.rank = dist.get_rank()
        self.coord = Coordinator(cfg, rd, alive, self.stop_requested) if self.rank == 0 else None
        self.learner = Learner(cfg)
        self.state: dict[str, Any] = {
            "iteration": -1,  # last iteration whose update the weights contain
            "version": 0,  # policy version on the servers
            "sft_done": False,
            "eval": [],  # [iteration, success]
            "wall_seconds": 0.0,
            "iteration_seconds": 0.0,  # the last iteration's length: a resume judges its budget by it
        }
        self.t_start, self.wall_before = time.time(), 0.0
        self.budget_spent = False  # trainer.max_wall_s: decided afresh by each launch
        self.codec = None
        if self.rank == 0:
            self.codec = ChatCodec.load(cfg.model.path)

    def any_rank(self, flag: bool) -> bool:
        """``flag`` set on any learner rank (a collective: every rank calls it)."""
        return bool(self.learner.backend.all_reduce_scalar(int(flag), "max", dtype=torch.int64))

    def stop_requested(self) -> bool:
        return _STOP["signal"] is not None or self.rd.stopping

    # ---- phases ----------------------------------------------------------------------------------
    def resume(self) -> None:
        """Load the newest usable checkpoint: one that fails its checksums or holds non-finite
        weights is renamed ``*.corrupt`` (kept for inspection) and the previous one is used."""
        if self.rank == 0:
            remove_partial_checkpoints(self.rd)
        dist.barrier()
        for ckpt in checkpoint_candidates(self.rd, self.cfg.trainer.resume):
            try:
                self.state.update(self.learner.load(ckpt))
            except CheckpointError as e:
                if self.cfg.trainer.resume != "auto":
                    raise
                log.error("%s; falling back to the previous checkpoint", e)
                dist.barrier()
                if self.rank == 0:
                    ckpt.rename(ckpt.with_name(ckpt.name + ".corrupt"))
                dist.barrier()
                continue
            self.wall_before = self.state["wall_seconds"]
            if self.learner.reward_scaler is not None and self.state.get("reward_scaling"):
                self.learner.reward_scaler.load_state_dict(self.state["reward_scaling"])
            log.info(
                "resumed from %s (iteration %d, version %d)",
                ckpt,
                self.state["iteration"],
                self.state["version"],
            )
            break
        if self.coord is not None:
            self.coord.prepare_resume(self.state["iteration"])
        self.reporter = Reporter(
            str(self.rd.tensorboard) if self.rank == 0 else None, self.state["iteration"] + 2
        )  # iteration i reports at step i + 1: drop what a dead run wrote after its checkpoint

    def push_weights(self) -> float:
        named = self.learner.gather_hf_weights()
        seconds = 0.0
        if self.coord is not None:
            bad = first_nonfinite(named.items())
            if bad is not None:  # never hand servers weights that make every logprob NaN
                raise FloatingPointError(
                    f"weight {bad} of policy version {self.state['version']} is not finite: not pushed "
                    f"(the last good weights are in {self.rd.checkpoints}; lower optim.lr or check the data)"
                )
            on_gpu = self.learner.device.type == "cuda"  # the weights wait in host memory
            seconds = self.coord.publisher.push(named, self.state["version"], on_gpu=on_gpu)
        dist.barrier()
        return seconds

    def evaluate(self, iteration: int) -> float | None:
        """Greedy success on the held-out split with the servers' current weights (None when a
        stop request interrupted it)."""
        success = None
        if self.coord is not None:
            task = self.coord.task("eval", iteration + 1, self.state["version"])
            self.coord.issue(task)
            try:
                pooled = self.coord.collect(task)
            except StopRequested:
                pooled = None
            if pooled is not None:
                success = pooled.get("success", 0.0) / max(pooled.get("episodes", 0.0), 1.0)
                self.state["eval"].append([iteration + 1, success])
                self.reporter.scalars(
                    {"eval/success": success, **rollout_scalars(pooled, "eval")}, iteration + 1
                )
        return _bcast(success)

    def checkpoint(self, iteration: int) -> None:
        """Save after ``iteration`` (-1: after the warm start, before any RL iteration; saved as
        ``iter_000000``, and a resume starts at iteration 0)."""
        self.state["iteration"] = iteration
        self.state["reward_scaling"] = self.learner.reward_scaling_state()
        self.state["wall_seconds"] = self.wall()
        self.learner.save(checkpoint_path(self.rd, max(iteration, 0)), dict(self.state))
        if self.rank == 0:  # keep the newest K
            import shutil

            done = list(iteration_dirs(self.rd.checkpoints).values())
            for p in done[: -self.cfg.trainer.keep_checkpoints]:
                shutil.rmtree(p, ignore_errors=True)
                shutil.rmtree(p.with_name(p.name + ".critic"), ignore_errors=True)
        dist.barrier()

    def wall(self) -> float:
        """Seconds of training over every launch of this run (a resumed run adds to its checkpoint's)."""
        return self.wall_before + (time.time() - self.t_start)

    # ---- the loop --------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        tr = self.cfg.trainer
        self.resume()
        try:
            self.warm_start()
        except StopRequested:
            log.warning("stop requested during the warm start: nothing to checkpoint yet, exiting")
            return self.finish(preempted=True)
        self.push_weights()
        first = self.state["iteration"] + 1
        if not self.state["eval"]:
            self.evaluate(first - 1)
        preempted = False
        if tr.iterations == 0 and self.state["sft_done"] and not iteration_dirs(self.rd.checkpoints):
            self.checkpoint(-1)  # a warm start alone: export it and share it (model.path, sft.steps=0)
        if first < tr.iterations and self.out_of_time(self.state.get("iteration_seconds", 0.0)):
            log.warning(
                "the wall budget (trainer.max_wall_s=%s) is spent: no iteration left to run", tr.max_wall_s
            )
        for it in range(first, first if self.budget_spent else tr.iterations):
            t_iter, times = time.time(), {}
            pooled = self.rollout(it, times)  # this iteration's records (prefetched in async mode)
            if pooled is None:  # stopped while waiting for them: keep what is trained
                if it > 0:
                    self.checkpoint(it - 1)
                log.warning("stop requested during the rollout of iteration %d: checkpointed, exiting", it)
                preempted = True
                break
            table, m = self.update(it, times)  # read, update, push weights, ledger
            self.state["iteration_seconds"] = time.time() - t_iter
            last = it == tr.iterations - 1 or self.out_of_time(self.state["iteration_seconds"])
            # a stop request (signal, STOP file): no evaluation (workers may be gone), checkpoint now
            stop = self.any_rank(self.stop_requested()) and not last
            if ((tr.eval_every and (it + 1) % tr.eval_every == 0) or last) and not stop:
                with _timed(times, "time/eval"):
                    success = self.evaluate(it)
                if success is not None:
                    m["eval/success"] = success
            if (tr.checkpoint_every and (it + 1) % tr.checkpoint_every == 0) or last or stop:
                with _timed(times, "time/checkpoint"):
                    self.checkpoint(it)
            if self.rank == 0:
                self.report(it, m, pooled, times, time.time() - t_iter, table)
            if stop:
                log.warning(
                    "stop requested (signal %s): checkpointed iteration %d, exiting", _STOP["signal"], it
                )
                preempted = True
                break
            if last and self.budget_spent:
                log.info(
                    "wall budget spent after iteration %d (%.0f s of %s)", it, self.wall(), tr.max_wall_s
                )
                break
        return self.finish(preempted)

    def out_of_time(self, next_s: float) -> bool:
        """Whether another iteration of ``next_s`` seconds would overrun ``trainer.max_wall_s``
        (decided together: every rank stops after the same iteration)."""
        budget = self.cfg.trainer.max_wall_s
        if budget > 0 and not self.budget_spent:
            self.budget_spent = self.any_rank(self.wall() + next_s > budget)
        return self.budget_spent

    def finish(self, preempted: bool) -> dict[str, Any]:
        summary = self.summary(preempted)
        if self.coord is not None:
            self.coord.close()
        self.reporter.close()
        return summary

    def rollout(self, it: int, times: dict[str, float]) -> dict[str, Any] | None:
        """Issue this iteration's task (and, in async and stream mode, the next ``max_staleness`` ones:
        the admission that bounds staleness) and wait for its committed records; their statistics
        on rank 0, ``{}`` elsewhere, None on a stop."""
        ahead = self.cfg.rollout.max_staleness if self.cfg.rollout.mode != "sync" else 0
        pooled: dict[str, Any] | None = {}
        if self.coord is not None:
            with _timed(times, "time/generate"):
                for k in range(it, min(it + ahead, self.cfg.trainer.iterations - 1) + 1):
                    self.coord.issue(self.coord.task("train", k, self.state["version"]))
                try:
                    pooled = self.coord.collect(self.coord.task("train", it, self.state["version"]))
                except StopRequested:
                    pooled = None
        return None if _bcast(pooled is None) else pooled

    def update(self, it: int, times: dict[str, float]):
        with _timed(times, "time/read"):
            table = self.learner.read(self.rd.records, it)
        with _timed(times, "time/train"):
            m = self.learner.update(table, self.state["version"], it)
        self.state["version"] += 1
        times["time/weight_sync"] = self.push_weights()
        if self.coord is not None:
            self.coord.record_consumed(it, self.state["version"])
        self.state["iteration"] = it
        return table, m

    def report(
        self,
        it: int,
        m: dict[str, float],
        pooled: dict[str, Any],
        times: dict[str, float],
        wall: float,
        table,
    ) -> None:
        m = {**m, **rollout_scalars(pooled), **times}
        m["time/iteration"] = wall
        m["time/idle"] = max(0.0, wall - sum(v for k, v in times.items() if k.startswith("time/")))
        m["time/learner_idle"] = times.get("time/generate", 0.0)  # waiting for this batch's records
        m["weight_sync/seconds"] = times.get("time/weight_sync", 0.0)
        if self.coord is not None and self.coord.publisher.last_push:
            m["weight_sync/gbps"] = self.coord.publisher.last_push["gbps"]
        if pooled.get("generate_s"):
            m["throughput/rollout_tokens_per_s"] = pooled.get("action_tokens", 0.0) / max(
                times.get("time/generate", 1e-9), 1e-9
            )
        m["throughput/train_tokens_per_s"] = m.get("train/tokens", 0.0) / max(
            times.get("time/train", 1e-9), 1e-9
        )
        m["policy/version"] = float(self.state["version"])
        # present when this launch generated the records; 0 unless something generated was not trained
        if pooled.get("generated_episodes"):
            m["length_bias/steps_per_episode"] = pooled["steps"] / max(pooled["episodes"], 1.0) - (
                pooled["generated_steps"] / pooled["generated_episodes"]
            )
        if self.coord is not None:
            idle = self.coord.server_idle_seconds()
            if idle is not None:
                m["time/server_idle"] = idle
        # how many versions behind the trained policy each step's action was sampled
        trained = self.state["version"] - 1
        self.reporter.histogram(
            "staleness/steps", trained - table.column("policy_version").to_numpy(zero_copy_only=False), it + 1
        )
        self.reporter.scalars(m, it + 1)
        for i, text in enumerate(sample_text(self.codec, table, self.cfg.trainer.sample_trajectories)):
            self.reporter.text(f"samples/{i}", text, it + 1)
        line = console_line(it, self.cfg.trainer.iterations, m)
        print(line, flush=True)
        log.info(line, extra={"console": False})

    def summary(self, preempted: bool) -> dict[str, Any]:
        evals = self.state["eval"]
        s = {
            "algorithm": self.cfg.algorithm.name,
            "iterations": self.state["iteration"] + 1,
            "eval_success_start": evals[0][1] if evals else None,
            "eval_success_end": evals[-1][1] if evals else None,
            "eval_curve": evals,
            "wall_seconds": round(self.wall(), 1),
            "budget_spent": self.budget_spent,
            "preempted": preempted,
            "run_dir": str(self.rd.root),
            "tensorboard": f"tensorboard --logdir {self.rd.tensorboard}",
        }
        if self.rank == 0:
            atomic_write_json(self.rd.summary, s)
        return s


def run_learner(cfg: TrainConfig, rd: RunDir, alive: Any = None) -> dict[str, Any]:
    """Entry of a learner rank once torch.distributed is initialised."""
    from megatron.core import parallel_state as ps

    if cfg.parallel.backend == "gloo":
        apply()
    cfg.parallel.initialize()
    install_signal_handlers()
    try:
        return Trainer(cfg, rd, alive).run()
    finally:
        ps.destroy_model_parallel()
