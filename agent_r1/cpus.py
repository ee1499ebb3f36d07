"""The cores a process may use, and the OpenMP wait policy every role that runs torch on a CPU
starts with.

``usable_cpus``: the CPUs this process is allowed to run on (``os.sched_getaffinity``: what
``taskset``, cgroup cpusets and Slurm's binding leave it), at most Slurm's ``--cpus-per-task``
(``SLURM_CPUS_PER_TASK``) — not ``os.cpu_count()``, the machine's.

``OMP_WAIT_POLICY=PASSIVE``: torch's OpenMP threads (libgomp) wait for each other at every
parallel region's barrier. By default a waiting thread spins; when the machine is shared (a
Slurm node runs a learner, rollout workers, a retriever and tool processes on the same cores) the
teammate it waits for is often descheduled, and the spinning thread burns its own time slice
waiting: measured in issue 41, ``agent-r1 serve`` beside one busy process fell to 0.05x its quiet
speed with the default policy and held 0.59x with PASSIVE (spinning buys ~15 % on an idle
machine). libgomp reads the variable once, when torch loads it, so ``omp_defaults`` runs before
anything imports torch (``agent-r1``'s entry point does it first); a value the user set wins.
"""

from __future__ import annotations

import os

OMP_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}


def usable_cpus() -> int:
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity API (macOS)
        n = os.cpu_count() or 1
    slurm = os.environ.get("SLURM_CPUS_PER_TASK", "")
    if slurm.isdigit() and int(slurm) > 0:
        n = min(n, int(slurm))
    return max(1, n)


def omp_defaults() -> None:
    """Set the OpenMP defaults in this process's environment (inherited by every process it
    starts) unless the user set them; effective only before torch is imported."""
    for k, v in OMP_DEFAULTS.items():
        os.environ.setdefault(k, v)
