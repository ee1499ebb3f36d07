"""Starting and stopping agent programs: a command (any language), or a Python callable run in a
child forked from a server that imported its module once (``agent_r1.forkserver``).

Every program runs in a process group of its own with its episode's environment, stdout and stderr
going to files in the episode's scratch folder (``AGENT_R1_WORKDIR``); ``Program.stop`` kills the
whole group, so nothing a program started outlives its episode.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from agent_r1.forkserver import ForkServer, Program, load

REWARD_LINE, ANSWER_LINE = "agent-r1-reward:", "agent-r1-answer:"


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


def run_agent(request: dict[str, Any]) -> None:
    """The forked child of a callable agent: its folder, stdio and environment, then
    ``FUNCTION(task)``; a returned number is printed as the reward line, a string as the answer
    line."""
    os.chdir(request["cwd"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        f = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    os.environ.update(request["env"])
    out = load(request["callable"])(request["task"])
    if hasattr(out, "__await__"):
        out = asyncio.run(out)
    if isinstance(out, int | float) and not isinstance(out, bool):
        print(f"{REWARD_LINE} {float(out)!r}")
    elif isinstance(out, str):
        print(f"{ANSWER_LINE} {json.dumps(out)}")


class CallableLauncher(Launcher):
    """``callable``: ``module:function``, called with the task (a dict) in a child forked from
    this process's fork server for that module."""

    def __init__(self, spec: str):
        mod, _, name = spec.partition(":")
        if not mod or not name:
            raise ValueError(f"agent callable {spec!r}: expected 'module:function'")
        self.spec, self.module = spec, mod

    async def start(self, task: dict[str, Any], env: dict[str, str], workdir: Path) -> Program:
        # the first start imports the module: not on the event loop
        server = await asyncio.to_thread(
            ForkServer.shared, "agent_r1.gateway.programs:run_agent", (self.module,)
        )
        return await server.start({"callable": self.spec, "task": task, "env": env, "cwd": str(workdir)})
