"""The run directory on the shared filesystem: the only interface between roles.

``config.yaml`` (resolved), ``records/`` (train shards), ``eval_records/``, ``checkpoints/``,
``tensorboard/``, ``weights/`` (disk weight sync), ``control/`` (server addresses, rollout tasks,
acknowledgements, stop flag), ``logs/`` (one file per role and rank), ``ledger.jsonl`` (what each
update consumed) and ``summary.json``.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("agent_r1.run_dir")


def atomic_write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True))
    os.replace(tmp, path)


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def node_address() -> str:
    """This node's address: ``AGENT_R1_HOST``; under Slurm the node's ``NodeAddr`` (several
    nodes may share one hostname, each with its own address); else the hostname's address."""
    if os.environ.get("AGENT_R1_HOST"):
        return os.environ["AGENT_R1_HOST"]
    node = os.environ.get("SLURMD_NODENAME")
    if node:
        try:
            out = subprocess.run(
                ["scontrol", "show", "node", node], capture_output=True, text=True, timeout=30, check=True
            ).stdout
            for tok in out.split():
                if tok.startswith("NodeAddr="):
                    return tok.split("=", 1)[1]
        except (OSError, subprocess.SubprocessError) as e:
            log.warning("scontrol show node %s failed (%s); using the hostname's address", node, e)
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


@dataclass(frozen=True)
class RunDir:
    root: Path

    @classmethod
    def at(cls, path: str | Path) -> RunDir:
        return cls(Path(path).resolve())

    config = property(lambda self: self.root / "config.yaml")
    records = property(lambda self: self.root / "records")
    eval_records = property(lambda self: self.root / "eval_records")
    checkpoints = property(lambda self: self.root / "checkpoints")
    tensorboard = property(lambda self: self.root / "tensorboard")
    weights = property(lambda self: self.root / "weights")
    control = property(lambda self: self.root / "control")
    servers = property(lambda self: self.root / "control" / "servers")
    teachers = property(lambda self: self.root / "control" / "teachers")
    tasks = property(lambda self: self.root / "control" / "tasks")
    roles = property(lambda self: self.root / "control" / "roles")
    logs = property(lambda self: self.root / "logs")
    ledger = property(lambda self: self.root / "ledger.jsonl")
    summary = property(lambda self: self.root / "summary.json")
    stop_flag = property(lambda self: self.root / "control" / "STOP")

    def create(self) -> RunDir:
        for d in (
            self.records,
            self.eval_records,
            self.checkpoints,
            self.tensorboard,
            self.weights,
            self.servers,
            self.teachers,
            self.tasks,
            self.roles,
            self.logs,
        ):
            d.mkdir(parents=True, exist_ok=True)
        return self

    def publish_role(self, name: str, info: dict[str, Any]) -> None:
        """Where a role runs (host, address, pid): for humans and for the other roles."""
        atomic_write_json(self.roles / f"{name}.json", {**info, "time": time.time()})

    def request_stop(self) -> None:
        self.stop_flag.parent.mkdir(parents=True, exist_ok=True)
        self.stop_flag.write_text(str(time.time()))

    @property
    def stopping(self) -> bool:
        return self.stop_flag.exists()

    def read_summary(self) -> dict[str, Any]:
        """``summary.json`` of a finished (or preempted) run; {} before there is one."""
        return read_json(self.summary) if self.summary.exists() else {}
