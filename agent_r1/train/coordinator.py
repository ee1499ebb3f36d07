"""The coordinator (learner rank 0): data cursor, rollout tasks, the ledger; its ``publisher``
(``weights.sender.WeightSender``) keeps the servers on the current weights.

Everything it tells other roles goes through the run directory (tasks, acknowledgements, server
addresses) or over HTTP to the rollout servers, so the same code drives local processes and
Slurm job steps.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from agent_r1.errors import RoleTimeout
from agent_r1.logging import Progress
from agent_r1.records.reader import RecordStore
from agent_r1.records.shard import drop_damaged_shards, finalize_iteration, iteration_dir, iteration_dirs
from agent_r1.train.config import TrainConfig
from agent_r1.train.metrics import STATS_COLUMNS, table_stats
from agent_r1.train.run_dir import RunDir, node_address, read_json
from agent_r1.train.tasks import RolloutTask, StopRequested, forget_tasks_after, task_name, write_task
from agent_r1.weights.sender import WeightSender

log = logging.getLogger("agent_r1.coordinator")


def prompt_indices(num_rows: int, per_iteration: int, seed: int, iteration: int) -> list[int]:
    """The data cursor: iteration ``i`` takes the next ``per_iteration`` prompts of a seeded
    permutation per epoch. A pure function of the iteration, so a resumed run continues exactly."""
    out: list[int] = []
    start = iteration * per_iteration
    while len(out) < per_iteration:
        epoch, offset = divmod(start + len(out), num_rows)
        perm = list(range(num_rows))
        random.Random(seed * 1_000_003 + epoch).shuffle(perm)
        out.extend(perm[offset : offset + per_iteration - len(out)])
    return out


def checkpoint_path(rd: RunDir, iteration: int) -> Path:
    return iteration_dir(rd.checkpoints, iteration)


def checkpoint_candidates(rd: RunDir, resume: str) -> list[Path]:
    """What to resume from, in order of preference: every complete checkpoint newest first
    (``resume=auto``: an unusable one falls back to the one before), an explicit one, or none."""
    if resume == "never":
        return []
    if resume != "auto":
        return [Path(resume)]
    done = [p for p in iteration_dirs(rd.checkpoints).values() if (p / "agent_r1_state.json").exists()]
    return done[::-1]


def remove_partial_checkpoints(rd: RunDir) -> None:
    """``iter_N.tmp`` folders of a save that was interrupted (never complete, never loaded)."""
    for p in rd.checkpoints.glob("*.tmp"):
        log.warning("removing the interrupted checkpoint %s", p)
        shutil.rmtree(p, ignore_errors=True)


class StallWatch:
    """A rollout is stalled when no episode finished for ``seconds`` while no live server could
    serve it (a dead server whose replacement never came up, or never got the weights)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.progress, self.since = -1, time.time()

    def check(self, done: int, live_servers: int) -> bool:
        now = time.time()
        if done != self.progress or live_servers > 0:
            self.progress, self.since = done, now
            return False
        return now - self.since > self.seconds


class Coordinator:
    def __init__(self, cfg: TrainConfig, rd: RunDir, alive: Any = None, should_stop: Any = None):
        self.cfg, self.rd, self.alive = cfg, rd, alive
        self.should_stop = should_stop or (lambda: False)
        # the weights the servers have
        self.publisher = WeightSender(
            cfg.rollout, rd.servers, rd.weights, node_address(), rd.api_key(), alive
        )
        self.next_resync = 0.0
        self.idle_seen: dict[str, float] = {}  # each server's idle seconds at the last report

    # ---- rollout tasks ---------------------------------------------------------------------------
    def task(self, kind: str, iteration: int, version: int) -> RolloutTask:
        cfg, rc = self.cfg, self.cfg.rollout
        if kind == "train":
            rows = prompt_indices(
                cfg.recipe.train_size, rc.prompts_per_iteration, cfg.trainer.seed, iteration
            )
            return RolloutTask(
                task_name(kind, iteration),
                kind,
                iteration,
                "train",
                rows,
                rc.group_size,
                cfg.episode,
                cfg.trainer.seed * 7919 + iteration,
                version,
                rc.workers,
                teacher=bool(cfg.algorithm.teacher),
                shards="group" if rc.mode == "stream" else "worker",
            )
        return RolloutTask(
            task_name(kind, iteration),
            kind,
            iteration,
            "test",
            list(range(cfg.recipe.test_size)),
            1,
            replace(cfg.episode, temperature=cfg.trainer.eval_temperature, top_p=1.0),
            cfg.trainer.seed,
            version,
            rc.workers,
        )

    def finalized(self, task: RolloutTask) -> bool:
        return (iteration_dir(self.rd.root / task.records_subdir, task.iteration) / "manifest.json").exists()

    def issue(self, task: RolloutTask) -> None:
        if not self.finalized(task) and not (self.rd.tasks / f"{task.name}.json").exists():
            write_task(self.rd, task)

    def collect(self, task: RolloutTask) -> dict[str, Any]:
        """Wait for every worker's shard (with a progress bar), finalize the iteration; episode
        statistics from the committed records (also when a previous run generated them)."""

        out_dir = self.rd.root / task.records_subdir
        acks: list[dict[str, Any]] = []
        if not self.finalized(task):
            acks = self._wait(task)
            finalize_iteration(out_dir, task.iteration, expected_writers=task.expected_shards)
        stats: dict[str, Any] = table_stats(
            RecordStore(out_dir).read(task.iteration, verify=False, columns=STATS_COLUMNS)
        )
        stats["reused"] = not acks or all(a.get("reused") for a in acks)
        stats["generate_s"] = max((a.get("generate_s", 0.0) for a in acks), default=0.0)
        if acks and all("generated_episodes" in a for a in acks):
            for k in ("generated_episodes", "generated_steps"):
                stats[k] = sum(a[k] for a in acks)
        return stats

    def server_idle_seconds(self) -> float | None:
        """Mean seconds the servers' engines had nothing to run since the last call (the embedded
        engine reports it; a dead server answers nothing; None when no server reports it)."""
        from agent_r1.http_service import published_urls
        from agent_r1.rollout.client import probe

        urls = published_urls(self.rd.servers)
        answers = self.publisher.loop.run_until_complete(
            probe(urls, "/server_info", api_key=self.rd.api_key())
        )
        idle = {}
        for u, a in zip(urls, answers, strict=True):
            states = a.get("internal_states") if isinstance(a, dict) else None
            if states and isinstance(states[0], dict) and "idle_s" in states[0]:
                idle[u] = float(states[0]["idle_s"])
        spans = [
            v - self.idle_seen[u] for u, v in idle.items() if u in self.idle_seen and v >= self.idle_seen[u]
        ]
        self.idle_seen = idle
        return sum(spans) / len(spans) if spans else None

    def _wait(self, task: RolloutTask) -> list[dict[str, Any]]:
        total = len(task.rows) * task.group_size
        bar = Progress(total=total, desc=f"rollout {task.name}", unit="ep", enabled=self.cfg.trainer.progress)
        deadline = time.time() + self.cfg.trainer.timeout_s
        paths = [self.rd.tasks / f"{task.name}.w{k}.done" for k in range(task.workers)]
        stall = StallWatch(self.cfg.rollout.ready_timeout_s)
        try:
            while True:
                missing = [k for k, p in enumerate(paths) if not p.exists()]
                if not missing:
                    return [read_json(p) for p in paths]
                done = 0
                for k in range(task.workers):
                    prog = self.rd.tasks / f"{task.name}.w{k}.progress"
                    if paths[k].exists():
                        done += len(task.share(k)) * task.group_size
                    elif prog.exists():
                        try:
                            done += int(prog.read_text() or 0)
                        except ValueError:
                            pass
                bar.update(done - bar.n)
                if self.alive is not None:
                    self.alive()
                if self.should_stop():
                    raise StopRequested(task.name)
                if time.time() >= self.next_resync:  # a replaced server gets the weights it lacks
                    self.next_resync = time.time() + self.publisher.RESYNC_EVERY_S
                    live = self.publisher.resync(task.weight_version)
                    if stall.check(done, live):
                        raise RoleTimeout(
                            f"rollout task {task.name} stalled: no progress for "
                            f"{stall.seconds:.0f} s and no live rollout server with weight version >= "
                            f"{task.weight_version} (see {self.rd.logs}/server_*.out and worker_*.log)"
                        )
                if time.time() > deadline:
                    raise RoleTimeout(
                        f"rollout task {task.name}: workers {missing} did not finish within "
                        f"{self.cfg.trainer.timeout_s:.0f} s (see {self.rd.logs}/worker_*.log)"
                    )
                time.sleep(0.05)
        finally:
            bar.close()

    def prepare_resume(self, iteration: int) -> None:
        """Forget what the dead run issued beyond ``iteration`` (committed shards are kept and
        reused) and drop ledger lines of updates the checkpoint does not contain."""
        forget_tasks_after(self.rd, iteration)
        # records of iterations to redo were never trained (the ledger below is cut to the
        # checkpoint): a damaged shard among them is generated again instead of stopping every rerun
        for i in iteration_dirs(self.rd.records):
            if i > iteration:
                for what in drop_damaged_shards(self.rd.records, i):
                    log.warning(
                        "iteration %d is redone: dropping its damaged shard (%s); it is generated again",
                        i,
                        what,
                    )
        for i, d in iteration_dirs(self.rd.eval_records).items():  # derived data: evaluate again
            if i > iteration + 1:
                shutil.rmtree(d, ignore_errors=True)
        if self.rd.ledger.exists():
            keep = []
            for line in self.rd.ledger.read_text().splitlines():
                try:
                    entry = json.loads(line) if line.strip() else None
                except ValueError:  # a line torn by a kill mid-write: that update is redone
                    log.warning("ledger: dropping the torn line %r", line[:80])
                    continue
                if entry is not None and entry["iteration"] <= iteration:
                    keep.append(line)
            self.rd.ledger.write_text("".join(line + "\n" for line in keep))

    def record_consumed(self, iteration: int, version: int) -> None:

        manifest = RecordStore(self.rd.records).manifest(iteration)
        entry = {
            "iteration": iteration,
            "version": version,
            "rows": manifest["rows"],
            "trajectories": manifest["num_trajectories"],
            "shards": {k: v["checksum"] for k, v in sorted(manifest["shards"].items())},
        }
        with self.rd.ledger.open("a") as f:
            f.write(json.dumps(entry) + "\n")

    def close(self) -> None:
        self.publisher.close()
