"""Every role starts with the cores it may use and OpenMP threads that yield instead of spinning."""

from __future__ import annotations

import os
import subprocess
import sys

from agent_r1.cpus import usable_cpus


def test_usable_cpus_is_the_affinity_capped_by_slurm(monkeypatch):
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    assert usable_cpus() == len(os.sched_getaffinity(0))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert usable_cpus() == 4
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "3")
    assert usable_cpus() == 3
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "16")
    assert usable_cpus() == 4  # Slurm's share is at most what the process may run on
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "")
    assert usable_cpus() == 4


def run(code: str, **env) -> str:
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "SLURM_CPUS_PER_TASK")}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**base, **env}, check=True
    )
    return out.stdout.strip()


def test_the_entry_point_loads_no_torch_before_the_command():
    """libgomp reads ``OMP_WAIT_POLICY`` when torch loads: ``agent-r1`` leaves torch to the command
    that needs it, so the user's value (PASSIVE on a shared node) is the one that counts."""
    probe = "import sys, agent_r1.cli; print('torch' in sys.modules)"
    assert run(probe) == "False"


def test_a_process_narrowed_to_one_core_counts_one(tmp_path):
    """``taskset`` one core (as Slurm's binding does): the count follows, where ``os.cpu_count()``
    would still say the machine's."""
    if len(os.sched_getaffinity(0)) < 2:
        import pytest

        pytest.skip("one core: nothing to narrow")
    code = "import os; os.sched_setaffinity(0, {0}); from agent_r1.cpus import usable_cpus; print(usable_cpus(), os.cpu_count())"
    assert run(code) == f"1 {os.cpu_count()}"
