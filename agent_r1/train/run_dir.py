"""The run directory on the shared filesystem: the only interface between roles.

``config.yaml`` (resolved), ``records/`` (train shards), ``eval_records/``, ``checkpoints/``,
``tensorboard/``, ``weights/`` (disk weight sync), ``control/`` (server addresses, rollout tasks,
acknowledgements, stop flag), ``logs/`` (one file per role and rank), ``ledger.jsonl`` (what each
update consumed) and ``summary.json``.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import secrets
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent_r1.errors import AgentR1Error
from agent_r1.jsonfiles import atomic_write_json, read_json  # noqa: F401  (the run's files)

log = logging.getLogger("agent_r1.run_dir")


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
    teachers = property(lambda self: self.helper_dir("teacher"))
    tasks = property(lambda self: self.root / "control" / "tasks")
    roles = property(lambda self: self.root / "control" / "roles")
    logs = property(lambda self: self.root / "logs")
    ledger = property(lambda self: self.root / "ledger.jsonl")
    summary = property(lambda self: self.root / "summary.json")
    stop_flag = property(lambda self: self.root / "control" / "STOP")
    router_file = property(lambda self: self.root / "control" / "router.json")
    retriever_file = property(lambda self: self.root / "control" / "retriever.json")
    env_server_file = property(lambda self: self.root / "control" / "env_server.json")
    shutdown_flag = property(lambda self: self.root / "control" / "SHUTDOWN")  # the run is over
    api_key_file = property(lambda self: self.root / "control" / "api_key")
    lock_file = property(lambda self: self.root / "control" / "owner.lock")

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

    def helper_dir(self, name: str) -> Path:
        """Where the servers of the helper model ``name`` publish their addresses."""
        return self.root / "control" / f"{name}s"

    def publish_role(self, name: str, info: dict[str, Any]) -> None:
        """Where a role runs (host, address, pid): for humans and for the other roles."""
        atomic_write_json(self.roles / f"{name}.json", {**info, "time": time.time()})

    def request_stop(self) -> None:
        self.stop_flag.parent.mkdir(parents=True, exist_ok=True)
        self.stop_flag.write_text(str(time.time()))

    @property
    def stopping(self) -> bool:
        return self.stop_flag.exists()

    def new_api_key(self) -> str:
        """A fresh key for this launch's servers, readable by its owner only (mode 0600)."""
        key = secrets.token_urlsafe(32)
        self.api_key_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.api_key_file.with_name(f".api_key.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key)
        os.replace(tmp, self.api_key_file)
        return key

    def api_key(self) -> str | None:
        """The key every server of this run requires (None: servers started without one)."""
        try:
            return self.api_key_file.read_text().strip() or None
        except FileNotFoundError:
            return None

    def read_summary(self) -> dict[str, Any]:
        """``summary.json`` of a finished (or preempted) run; {} before there is one."""
        return read_json(self.summary) if self.summary.exists() else {}


class RunDirBusy(AgentR1Error, RuntimeError):
    """Another live process owns the run directory (its PID and host are in the message)."""


class RunLock:
    """One owner per run directory: an exclusive ``flock`` on ``control/owner.lock``, held for the
    life of the run by the local launcher (or, under Slurm, by learner rank 0). The kernel drops it
    when the owner dies, however it dies, so a stale lock is taken over without any clean-up; the
    file also names the owner (pid, host, start time) for the refusal message."""

    def __init__(self, rd: RunDir):
        self.rd = rd
        self.fd: int | None = None

    def acquire(self, what: str = "agent-r1 train") -> RunLock:
        path = self.rd.lock_file
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _read_owner(fd)
            os.close(fd)
            raise RunDirBusy(
                f"run directory {self.rd.root} is in use by {owner.get('what', 'another run')} "
                f"(pid {owner.get('pid', '?')} on host {owner.get('host', '?')}, started "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(owner.get('time', 0)))}): "
                "stop that run first, or choose another trainer.run_dir"
            ) from None
        os.ftruncate(fd, 0)
        info = {"pid": os.getpid(), "host": socket.gethostname(), "time": time.time(), "what": what}
        os.pwrite(fd, json.dumps(info).encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> RunLock:
        return self.acquire() if self.fd is None else self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def _read_owner(fd: int) -> dict[str, Any]:
    try:
        return json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
