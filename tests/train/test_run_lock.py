"""One owner per run directory: a live owner refuses a second, a dead owner's lock is taken over."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from agent_r1.train.run_dir import RunDir, RunDirBusy, RunLock

HOLD = """
import sys, time
from agent_r1.train.run_dir import RunDir, RunLock
RunLock(RunDir.at(sys.argv[1]).create()).acquire("the test's holder")
print("held", flush=True)
time.sleep(600)
"""


def test_live_owner_refuses_and_dead_owner_is_taken_over(tmp_path):
    rd = RunDir.at(tmp_path / "run").create()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(rd.root)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirBusy, match=rf"in use by the test's holder \(pid {holder.pid} on host"):
            RunLock(rd).acquire()
        os.kill(holder.pid, signal.SIGKILL)  # dies without releasing anything
        holder.wait(10)
        # never blocks (LOCK_NB): it succeeds because the kernel released the dead owner's lock
        lock = RunLock(rd).acquire("the successor")
        assert f'"pid": {os.getpid()}' in rd.lock_file.read_text()
        lock.release()
    finally:
        if holder.poll() is None:
            holder.kill()


def test_api_key_file_is_private_and_fresh_per_launch(tmp_path):
    rd = RunDir.at(tmp_path / "run").create()
    assert rd.api_key() is None
    k1 = rd.new_api_key()
    assert rd.api_key() == k1 and len(k1) >= 32
    assert (rd.api_key_file.stat().st_mode & 0o777) == 0o600
    assert rd.new_api_key() != k1
