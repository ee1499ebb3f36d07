"""The cores a process may use (every role sizes its torch threads from them), the governor
that chooses how many of them torch uses while a loop runs, whether the CPU computes in bf16
(``bf16_units``: the serving default, ``serving_dtype``) and glibc's malloc told to keep large
freed blocks (``keep_freed_blocks``: no page faults per step in a learner or an engine).

``usable_cpus``: the CPUs this process is allowed to run on (``os.sched_getaffinity``: what
``taskset``, cgroup cpusets and Slurm's binding leave it), at most Slurm's ``--cpus-per-task``
(``SLURM_CPUS_PER_TASK``) — not ``os.cpu_count()``, the machine's.

``ThreadGovernor``: with OpenMP's default wait policy torch's threads spin at every barrier;
fastest on a quiet machine, they collapse when another process takes a core (the teammate a
spinning thread waits for is descheduled: the engine fell to 0.10x, the quickstart's warm start to
0.13x beside one busy loop on 2 cores). ``OMP_WAIT_POLICY=PASSIVE`` holds there but costs about
what the second thread buys on a quiet machine (0.54x), and no spin count keeps both. The governor
keeps the default policy and chooses the thread count (1 or all) from the loop's own step times:
0.96x quiet, and beside the busy loop the engine holds 0.43x of its quiet speed and the warm start
0.60x (docs/performance.md). The embedded engine's scheduler and the learner's optimizer steps run
under one on a CPU. A user's ``OMP_WAIT_POLICY`` still reaches libgomp: ``agent-r1`` imports torch
only inside the command that needs it.
"""

from __future__ import annotations

import os

BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def bf16_units(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """The CPU computes in bfloat16 natively (AVX512_BF16 or AMX-BF16 in its flags): bf16 matmuls
    run at 2-3x float32 there, and emulated elsewhere (slower than float32)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return any(flag in line.split() for flag in BF16_FLAGS)
    except OSError:
        pass
    return False


def serving_dtype(device: str = "cpu") -> str:
    """A rollout engine's default precision: bfloat16 on a GPU or a CPU with bf16 units, float32
    on other CPUs (bf16 there is emulated: slower than float32)."""
    return "bfloat16" if not device.startswith("cpu") or bf16_units() else "float32"


def keep_freed_blocks() -> bool:
    """Let glibc's malloc keep large freed blocks for reuse instead of handing each one back to the
    kernel. By default every block over a (dynamic, <= 32 MB) threshold is a fresh ``mmap`` that
    the kernel zero-fills page by page and ``munmap`` returns at ``free``: a loop that allocates and
    frees the same large tensors every step (a learner's activations and gradients, an engine's
    logits and attention scores) pays those page faults every step -- what jemalloc / tcmalloc
    avoid in PyTorch's CPU tuning guides. Peak memory grows a little (the kept blocks are the
    ones the next step needs again). For processes that compute on the host; returns whether it
    applied (False without glibc)."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    m_trim_threshold, m_mmap_threshold = -1, -3
    # blocks up to 1 GiB come from the heap; up to 2 GiB free at its top stay mapped
    return bool(mallopt(m_mmap_threshold, 1 << 30)) and bool(mallopt(m_trim_threshold, (1 << 31) - 1))


def usable_cpus() -> int:
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity API (macOS)
        n = os.cpu_count() or 1
    slurm = os.environ.get("SLURM_CPUS_PER_TASK", "")
    if slurm.isdigit() and int(slurm) > 0:
        n = min(n, int(slurm))
    return max(1, n)


class ThreadGovernor:
    """Chooses torch's thread count while a loop runs, from the loop's own step times.

    With OpenMP's default policy, several threads are fastest on a quiet machine and collapse when
    another process takes a core (a thread spins at every barrier for a teammate the kernel
    descheduled); one thread never waits for anyone. So the loop runs at its best count and now
    and then runs two steps at the other one (1 or ``threads``); it switches when the second of
    them costs a quarter less per unit of work than recent steps of the same size (sizes in
    powers of two: per-token costs differ with the batch). The first probe comes after ``first``
    steps; a probe that confirms the current count makes the wait four times longer (up to
    ``most``), a switch resets it, so a steady machine pays less and less for probing and a change
    is caught within ``most`` steps. Call ``pick`` before a step and ``record`` after it, in the
    thread that runs the step (OpenMP settings are per thread)."""

    def __init__(self, threads: int, first: int = 8, most: int = 512, margin: float = 0.75):
        self.threads, self.first, self.most, self.margin = threads, first, most, margin
        self.best = threads
        self.recent: dict[int, float] = {}  # size bucket -> cost per unit of work at ``best``
        self.wait = first  # steps until the next probe
        self.interval = first
        self.probe: list[tuple[int, float]] = []
        self.probing = False
        self.switches = 0

    @property
    def active(self) -> bool:
        return self.threads > 1

    @property
    def other(self) -> int:
        return 1 if self.best > 1 else self.threads

    def _set(self, n: int) -> None:
        import torch

        if torch.get_num_threads() != n:
            torch.set_num_threads(n)

    def pick(self, probe: bool = True) -> int:
        """The count for the next step; ``probe=False``: a step that will not be recorded (a due
        probe waits for one that will, rather than running unmeasured work at the other count)."""
        if not self.active:
            return self.threads
        if not self.probing and self.recent:
            self.wait -= 1
            self.probing = self.wait <= 0
        n = self.other if self.probing and probe else self.best
        self._set(n)
        return n

    def record(self, seconds: float, work: int) -> None:
        if not self.active or work <= 0:
            return
        size, cost = work.bit_length(), seconds / work
        if not self.probing:
            old = self.recent.get(size)
            self.recent[size] = cost if old is None else 0.7 * old + 0.3 * cost
            return
        self.probe.append((size, cost))
        if len(self.probe) < 2:  # the second counts: the first may pay for waking threads
            return
        (size, cost), self.probe, self.probing = self.probe[1], [], False
        if size not in self.recent:  # nothing of its size to compare with: probe again soon
            self.wait = self.first
            return
        if cost < self.margin * self.recent[size]:
            self.best, self.recent = self.other, {size: cost}
            self.switches += 1
            self.interval = self.first
        else:
            self.interval = min(4 * self.interval, self.most)
        self.wait = self.interval
