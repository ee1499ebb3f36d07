"""The cores a process may use (every role sizes its torch threads from them), and what was
measured of OpenMP's wait policy.

``usable_cpus``: the CPUs this process is allowed to run on (``os.sched_getaffinity``: what
``taskset``, cgroup cpusets and Slurm's binding leave it), at most Slurm's ``--cpus-per-task``
(``SLURM_CPUS_PER_TASK``) — not ``os.cpu_count()``, the machine's.

The OpenMP wait policy is left to the user (``OMP_WAIT_POLICY``, read by libgomp once, when torch
loads; ``agent-r1`` imports torch only inside the command that needs it, so a value in the
environment takes effect). Measured on a 2-core machine (``tools/bench/contention.py``,
docs/performance.md): with the default policy torch's threads spin at every barrier, fastest when
the machine is quiet and collapsing beside one busy process (the engine at 0.15x, the quickstart's
warm start at 0.13x), because the teammate a spinning thread waits for is descheduled; PASSIVE
holds beside the neighbour but costs 40-45 % on a quiet machine at 2 threads (futex wake-ups at
every barrier), as much as giving up the second thread. Neither is a default that fits both
cases; on a node whose cores are shared, set ``OMP_WAIT_POLICY=PASSIVE`` or fewer threads.
"""

from __future__ import annotations

import os


def usable_cpus() -> int:
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity API (macOS)
        n = os.cpu_count() or 1
    slurm = os.environ.get("SLURM_CPUS_PER_TASK", "")
    if slurm.isdigit() and int(slurm) > 0:
        n = min(n, int(slurm))
    return max(1, n)
