"""A fork server: ``python -m agent_r1.forkserver MODULE:ENTRY [PRELOAD ...]``, and its client.

It imports ``ENTRY``'s module and the ``PRELOAD`` modules once (the ``openai`` SDK or pandas alone
take a second or more to import), then forks one child per request. Requests come as JSON lines
on stdin (``{"id", ...}``); it answers ``{"id", "pid"}`` once the child runs and ``{"id",
"exit"}`` when it ends (the exit status; a negative one is the signal that killed it). A child
starts its own session (its process group holds everything it starts: ``Program.stop`` kills the
group) and calls ``ENTRY(request)``; returning is exit 0, an exception exit 1 with its traceback on
the child's stderr. The server keeps no threads, so forking it is safe; when its stdin closes (its
owner is gone) it kills every child's group and exits.

Users: the gateway's Python agents (``gateway.programs``) and the sandboxed ``python`` tool.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import itertools
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any


def load(spec: str) -> Any:
    """``module:function`` -> the function (a clear error for a bad spec)."""
    mod, _, name = spec.partition(":")
    if not mod or not name:
        raise ValueError(f"{spec!r}: expected 'module:function'")
    fn = getattr(importlib.import_module(mod), name, None)
    if not callable(fn):
        raise ValueError(f"{spec!r}: {mod} has no function {name}")
    return fn


@dataclass
class Program:
    """A running child: its process group and its exit status (awaitable)."""

    pid: int
    exited: Awaitable[int]

    def stop(self) -> None:
        """Kill the whole process group (what it started too); gone already is fine."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class ForkServer:
    """The client: one server process and the thread that reads its answers. ``shared`` gives
    this process's server for an entry (started on first use, again if it died)."""

    _shared: dict[tuple[str, tuple[str, ...]], ForkServer] = {}
    _guard = threading.Lock()

    @classmethod
    def shared(cls, entry: str, preload: tuple[str, ...] = ()) -> ForkServer:
        with cls._guard:
            s = cls._shared.get((entry, preload))
            if s is None or not s.alive:
                s = cls._shared[(entry, preload)] = cls(entry, preload)
            return s

    def __init__(self, entry: str, preload: tuple[str, ...] = ()):
        self.entry = entry
        err = tempfile.TemporaryFile()  # its own errors (an import that fails): read back below
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agent_r1.forkserver", entry, *preload],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
        )
        if not self.proc.stdout.readline():  # type: ignore[union-attr]
            self.proc.wait()
            err.seek(0)
            text = err.read().decode(errors="replace").strip().splitlines()
            raise ValueError(
                f"{entry} {' '.join(preload)}: cannot start: {text[-1] if text else 'no output'}"
            )
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._pids: dict[int, concurrent.futures.Future] = {}
        self._exits: dict[int, concurrent.futures.Future] = {}
        threading.Thread(target=self._read, name=f"forkserver-{entry}", daemon=True).start()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            msg = json.loads(line)
            with self._lock:
                f = self._pids.pop(msg["id"]) if "pid" in msg else self._exits.pop(msg["id"])
                if not f.done():  # a caller that stopped waiting cancelled it
                    f.set_result(msg["pid"] if "pid" in msg else msg["exit"])
        with self._lock:  # the server died: every child it had counts as crashed
            dead = RuntimeError(f"the fork server of {self.entry} died (exit {self.proc.wait()})")
            for f in [*self._pids.values(), *self._exits.values()]:
                if not f.done():
                    f.set_exception(dead)
            self._pids.clear()
            self._exits.clear()

    async def start(self, request: dict[str, Any]) -> Program:
        i = next(self._ids)
        pid_f: concurrent.futures.Future = concurrent.futures.Future()
        exit_f: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if not self.alive:
                raise RuntimeError(f"the fork server of {self.entry} is not running")
            self._pids[i], self._exits[i] = pid_f, exit_f
            self.proc.stdin.write((json.dumps({**request, "id": i}) + "\n").encode())  # type: ignore[union-attr]
            self.proc.stdin.flush()  # type: ignore[union-attr]
        pid = await asyncio.wrap_future(pid_f)
        return Program(pid, asyncio.wrap_future(exit_f))


def _child(entry: Any, request: dict[str, Any]) -> None:
    """In the forked child: never returns."""
    code = 1
    try:
        os.setsid()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        entry(request)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - the child's own error: its traceback goes to its stderr
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def main(argv: list[str]) -> int:
    entry = load(argv[0])
    for name in argv[1:]:
        importlib.import_module(name)
    out = sys.stdout

    def say(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    say({"ready": True})
    children: dict[int, Any] = {}
    fd, pending = sys.stdin.fileno(), b""  # raw reads: a buffered reader would hide lines from select
    while True:
        r, _, _ = select.select([fd], [], [], 0.05)
        if r:
            chunk = os.read(fd, 1 << 16)
            if not chunk:  # the owner is gone: nothing may outlive it
                for pid in children:
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                return 0
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                req = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _child(entry, req)
                children[pid] = req["id"]
                say({"id": req["id"], "pid": pid})
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            if pid in children:
                say({"id": children.pop(pid), "exit": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
