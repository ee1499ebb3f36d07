"""The fork server of a Python agent: ``python -m agent_r1.gateway.zygote MODULE:FUNCTION``.

It imports the agent's module once (the ``openai`` SDK alone takes over a second to import), then
forks one child per episode. Requests come as JSON lines on stdin: ``{"id", "task", "env",
"cwd"}``; it answers ``{"id", "pid"}`` once the child runs and ``{"id", "exit"}`` when it ends
(the exit status; a negative one is the signal that killed it). A child starts its own session
(its process group is the episode's: killing the group stops everything it started), reads its
environment (``OPENAI_BASE_URL`` ...) from the request, writes stdout and stderr to files in its
``cwd`` and calls ``FUNCTION(task)``; a returned number is printed as the episode's reward line,
a returned string as its answer line. The zygote keeps no threads, so forking it is safe; when
its stdin closes (the worker is gone) it kills every child's group and exits.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import sys
from typing import Any

REWARD_LINE, ANSWER_LINE = "agent-r1-reward:", "agent-r1-answer:"


def load(spec: str) -> Any:
    """``module:function`` -> the function (a clear error for a bad spec)."""
    mod, _, name = spec.partition(":")
    if not mod or not name:
        raise ValueError(f"agent callable {spec!r}: expected 'module:function'")
    fn = getattr(importlib.import_module(mod), name, None)
    if not callable(fn):
        raise ValueError(f"agent callable {spec!r}: {mod} has no function {name}")
    return fn


def run_child(fn: Any, req: dict[str, Any]) -> None:
    """In the forked child: never returns."""
    code = 1
    try:
        os.setsid()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.chdir(req["cwd"])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, name in ((1, "stdout"), (2, "stderr")):
            f = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(f, fd)
            os.close(f)
        sys.stdout = os.fdopen(1, "w", buffering=1)
        sys.stderr = os.fdopen(2, "w", buffering=1)
        os.environ.update(req["env"])
        out = fn(req["task"])
        if hasattr(out, "__await__"):
            import asyncio

            out = asyncio.run(out)
        if isinstance(out, bool) or out is None:
            pass
        elif isinstance(out, int | float):
            print(f"{REWARD_LINE} {float(out)!r}")
        elif isinstance(out, str):
            print(f"{ANSWER_LINE} {json.dumps(out)}")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - the agent's own error: its traceback goes to its stderr
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def main(argv: list[str]) -> int:
    fn = load(argv[0])
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
            if not chunk:  # the worker is gone: nothing may outlive it
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
                    run_child(fn, req)
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
