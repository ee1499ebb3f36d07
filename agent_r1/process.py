"""Child processes that do not outlive their parent, and the ports they are told to listen on."""

from __future__ import annotations

import os
import signal
import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago, for a process that must be *told* where to listen (a
    server started as a child). Another process can take it before that one binds it: whatever
    listens in this process binds port 0 itself instead (the learners' ``TCPStore``)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def die_with_parent():
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets SIGKILL when the process that
    starts it dies (Linux ``PR_SET_PDEATHSIG``), however it dies (kill -9, OOM, a full disk), so
    nothing is left behind to race a restart. None where prctl does not exist."""
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def child() -> None:
        prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died between fork and prctl
            os._exit(1)

    return child


def wait_or_stop(proc, stop_when=None, poll_s: float = 1.0) -> int:
    """Wait for ``proc``; when ``stop_when()`` turns true, terminate it and return 0 (a requested
    stop is a normal end)."""
    import time

    while proc.poll() is None:
        if stop_when is not None and stop_when():
            proc.terminate()
            try:
                proc.wait(30)
            except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired: it would not stop
                proc.kill()
                proc.wait()
            return 0
        time.sleep(poll_s)
    return proc.returncode
