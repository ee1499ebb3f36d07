"""Run a worker script as ``world`` gloo ranks on loopback (one thread each) and fail with their logs."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path


def spawn_ranks(script: Path, world: int, *args: str, timeout: float = 900) -> None:
    """``python script RANK WORLD PORT *args`` for every rank; raises with the tail of each log."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    helpers = str(Path(__file__).resolve().parent)  # the rank scripts import megatron_rank from here
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [helpers, *filter(None, [os.environ.get("PYTHONPATH")])])}  # fmt: skip
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), str(world), port, *map(str, args)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    logs = [p.communicate(timeout=timeout)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise AssertionError("\n".join(log[-4000:] for log in logs))
