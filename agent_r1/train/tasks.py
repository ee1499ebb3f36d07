"""Rollout tasks: how the coordinator hands prompts to rollout workers through the run directory.

The coordinator writes ``control/tasks/<name>.json`` (atomically); every worker runs its share of
the prompts, commits one record shard for it and writes ``<name>.w<k>.done`` with its metrics.
A task is idempotent: a worker that finds its shard already committed (after a restart) only
acknowledges it, so a resumed run never generates or trains a record twice.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from agent_r1.agent.episode import EpisodeSettings
from agent_r1.train.run_dir import RunDir, atomic_write_json, read_json


class StopRequested(Exception):
    """A stop was requested (signal or STOP file) while waiting on another role."""


@dataclass
class RolloutTask:
    name: str  # train_000012 | eval_000010
    kind: str  # train | eval
    iteration: int  # the shard iteration in records/ (train) or eval_records/ (eval)
    split: str  # recipe split the rows come from
    rows: list[int]  # row indices into the split
    group_size: int
    episode: EpisodeSettings  # budgets and sampling, whole: every worker runs the same episodes
    seed: int
    weight_version: int  # servers must have at least this version
    workers: int  # how many workers share the task
    teacher: bool = False  # ask the teacher server for per-token logprobs (OPD)
    created: float = field(default_factory=time.time)
    # worker: one shard per worker, committed when its share is done | group: one shard per group,
    # committed as soon as the group finishes (streaming: a long episode holds back only its group)
    shards: str = "worker"

    @property
    def records_subdir(self) -> str:
        return "records" if self.kind == "train" else "eval_records"

    def share(self, worker: int) -> list[tuple[int, int]]:
        """(position in the task, row index) of this worker's prompts: whole groups per worker."""
        return [(i, r) for i, r in enumerate(self.rows) if i % self.workers == worker]

    @property
    def expected_shards(self) -> int:
        """Committed shards that complete the task's iteration."""
        return self.workers if self.shards == "worker" else len(self.rows)


def task_name(kind: str, iteration: int) -> str:
    return f"{kind}_{iteration:06d}"


def write_task(rd: RunDir, task: RolloutTask) -> None:
    atomic_write_json(rd.tasks / f"{task.name}.json", asdict(task))


def read_task(path: Path) -> RolloutTask:
    d = read_json(path)
    return RolloutTask(**{**d, "episode": EpisodeSettings(**d["episode"])})


def pending_tasks(rd: RunDir, worker: int) -> list[RolloutTask]:
    """Tasks this worker has not acknowledged, oldest first."""
    out = []
    for p in sorted(rd.tasks.glob("*.json"), key=lambda p: p.stat().st_mtime):
        if ".w" in p.stem:
            continue
        if not (rd.tasks / f"{p.stem}.w{worker}.done").exists():
            out.append(read_task(p))
    return out


def acknowledge(rd: RunDir, task: RolloutTask, worker: int, metrics: dict[str, Any]) -> None:
    atomic_write_json(rd.tasks / f"{task.name}.w{worker}.done", metrics)


def forget_tasks_after(rd: RunDir, iteration: int) -> None:
    """On resume: tasks the dead run issued beyond the checkpoint are issued again (identically)."""
    for p in rd.tasks.iterdir():
        stem = p.name.split(".")[0]
        kind, _, num = stem.partition("_")
        if num.isdigit() and int(num) > iteration:
            p.unlink(missing_ok=True)
