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


def test_the_entry_point_sets_the_wait_policy_before_torch_loads():
    """``agent-r1``'s module sets it before any command imports torch (libgomp reads it at load);
    a user's own value wins; the roles the launcher starts inherit it."""
    probe = "import sys, os, agent_r1.cli as c; t = 'torch' in sys.modules; c.build_parser(); print(t, os.environ['OMP_WAIT_POLICY'])"
    assert run(probe) == "False PASSIVE"
    assert run(probe, OMP_WAIT_POLICY="ACTIVE") == "False ACTIVE"


def test_a_process_narrowed_to_one_core_counts_one(tmp_path):
    """``taskset`` one core (as Slurm's binding does): the count follows, where ``os.cpu_count()``
    would still say the machine's."""
    if len(os.sched_getaffinity(0)) < 2:
        import pytest

        pytest.skip("one core: nothing to narrow")
    code = "import os; os.sched_setaffinity(0, {0}); from agent_r1.cpus import usable_cpus; print(usable_cpus(), os.cpu_count())"
    assert run(code) == f"1 {os.cpu_count()}"
