"""Starting and stopping agent programs: a command (any language), or a Python callable forked from
a zygote that imported its module once (``zygote``).

Every program runs in a process group of its own with its episode's environment, stdout and stderr
going to files in the episode's scratch folder (``AGENT_R1_WORKDIR``); ``Program.stop`` kills the
whole group, so nothing a program started outlives its episode.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Program:
    """A running agent program: its process group and its exit status (awaitable)."""

    pid: int
    exited: Awaitable[int]

    def stop(self) -> None:
        """Kill the program's whole process group (what it started too); gone already is fine."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class Launcher:
    async def start(self, task: dict[str, Any], env: dict[str, str], workdir: Path) -> Program:
        raise NotImplementedError


class CommandLauncher(Launcher):
    """``command``: an argv list, run in the worker's working directory; the task is the JSON file
    named by ``AGENT_R1_TASK``."""

    def __init__(self, command: list[str]):
        if not command or not all(isinstance(a, str) for a in command):
            raise ValueError(f"agent command: a non-empty list of strings, got {command!r}")
        self.command = list(command)

    async def start(self, task: dict[str, Any], env: dict[str, str], workdir: Path) -> Program:
        with open(workdir / "stdout", "wb") as out, open(workdir / "stderr", "wb") as err:
            try:
                proc = await asyncio.create_subprocess_exec(
                    *self.command,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
                    env={**os.environ, **env},
                    start_new_session=True,
                )
            except OSError as e:
                raise ValueError(f"agent command {self.command}: cannot start ({e})") from None
        return Program(proc.pid, proc.wait())


class Zygote:
    """One zygote process and the thread that reads its answers."""

    def __init__(self, spec: str):
        self.spec = spec
        err = tempfile.TemporaryFile()  # its own errors (an import that fails): read back below
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agent_r1.gateway.zygote", spec],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
        )
        if not self.proc.stdout.readline():  # type: ignore[union-attr]
            self.proc.wait()
            err.seek(0)
            text = err.read().decode(errors="replace").strip().splitlines()
            raise ValueError(f"agent callable {spec!r} cannot start: {text[-1] if text else 'no output'}")
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._pids: dict[int, concurrent.futures.Future] = {}
        self._exits: dict[int, concurrent.futures.Future] = {}
        threading.Thread(target=self._read, name=f"zygote-{spec}", daemon=True).start()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            msg = json.loads(line)
            with self._lock:
                if "pid" in msg:
                    self._pids.pop(msg["id"]).set_result(msg["pid"])
                else:
                    self._exits.pop(msg["id"]).set_result(msg["exit"])
        with self._lock:  # the zygote died: every program it had counts as crashed
            dead = RuntimeError(f"the agent zygote of {self.spec!r} died (exit {self.proc.wait()})")
            for f in [*self._pids.values(), *self._exits.values()]:
                f.set_exception(dead)
            self._pids.clear()
            self._exits.clear()

    async def start(self, task: dict[str, Any], env: dict[str, str], workdir: Path) -> Program:
        i = next(self._ids)
        pid_f: concurrent.futures.Future = concurrent.futures.Future()
        exit_f: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if not self.alive:
                raise RuntimeError(f"the agent zygote of {self.spec!r} is not running")
            self._pids[i], self._exits[i] = pid_f, exit_f
            req = {"id": i, "task": task, "env": env, "cwd": str(workdir)}
            self.proc.stdin.write((json.dumps(req) + "\n").encode())  # type: ignore[union-attr]
            self.proc.stdin.flush()  # type: ignore[union-attr]
        pid = await asyncio.wrap_future(pid_f)
        return Program(pid, asyncio.wrap_future(exit_f))


class CallableLauncher(Launcher):
    """``callable``: ``module:function``, called with the task (a dict) in a child forked from
    this process's zygote for that callable (started on first use, again if it died)."""

    _zygotes: dict[str, Zygote] = {}
    _guard = threading.Lock()

    def __init__(self, spec: str):
        mod, _, name = spec.partition(":")
        if not mod or not name:
            raise ValueError(f"agent callable {spec!r}: expected 'module:function'")
        self.spec = spec

    def zygote(self) -> Zygote:
        with self._guard:
            z = self._zygotes.get(self.spec)
            if z is None or not z.alive:
                z = self._zygotes[self.spec] = Zygote(self.spec)
            return z

    async def start(self, task: dict[str, Any], env: dict[str, str], workdir: Path) -> Program:
        z = await asyncio.to_thread(self.zygote)  # the first start imports the module: not on the loop
        return await z.start(task, env, workdir)
