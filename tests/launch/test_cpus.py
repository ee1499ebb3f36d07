"""Every role starts with the cores it may use and OpenMP threads that yield instead of spinning."""

from __future__ import annotations

import os
import subprocess
import sys

from agent_r1 import cpus
from agent_r1.cpus import bf16_units, serving_dtype, usable_cpus


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


class Machine:
    """A loop's step costs per token at each thread count, as the governor would measure them."""

    def __init__(self, costs: dict[int, float]):
        self.costs = costs

    def run(self, gov, steps: int, work: int = 16) -> list[int]:
        used = []
        for _ in range(steps):
            n = gov.pick()
            used.append(n)
            gov.record(self.costs[n] * work, work)
        return used


def governor():
    from agent_r1.cpus import ThreadGovernor

    g = ThreadGovernor(2)
    g._set = lambda n: None  # the counts are what is under test, not torch's
    return g


def test_the_governor_keeps_the_threads_on_a_quiet_machine_and_probes_ever_less():
    g = governor()
    used = Machine({2: 1.0, 1: 1.6}).run(g, 2000)
    assert g.best == 2 and g.switches == 0
    probes = used.count(1)
    assert 0 < probes <= 2 * 6  # waits of 8, 32, 128, 512, 512, ...: a probe (two steps) each
    assert used[-300:].count(1) <= 2


def test_the_governor_drops_to_one_thread_when_a_core_is_taken_and_comes_back():
    g = governor()
    busy = Machine({2: 7.0, 1: 1.7})  # spinning threads waiting for a descheduled teammate
    used = busy.run(g, 12)
    assert g.best == 1 and g.switches == 1 and used[-1] == 1  # within the first probe
    busy.run(g, 1000)
    assert g.best == 1 and g.switches == 1  # probes of 2 threads keep losing
    quiet = Machine({2: 1.0, 1: 1.6})
    used = quiet.run(g, 600)  # the neighbour left: back within the longest wait
    assert g.best == 2 and g.switches == 2 and used[-1] == 2


def test_a_probe_is_compared_only_with_steps_of_its_size():
    """Per-token costs fall with the batch: a probe of another size says nothing."""
    g = governor()
    Machine({2: 4.0, 1: 6.0}).run(g, 8, work=2)  # small batches: dear per token
    Machine({2: 1.0, 1: 1.6}).run(g, 2, work=64)  # the probe lands on a big batch
    assert g.best == 2 and g.switches == 0


def test_a_due_probe_waits_for_a_step_that_will_be_timed():
    """Steps that will not be recorded (the engine's prefills) run at the best count even when a
    probe is due; the probe then takes the next timed steps."""
    g = governor()
    Machine({2: 1.0, 1: 1.6}).run(g, 8)  # the first probe is due on the next step
    untimed = [g.pick(probe=False) for _ in range(5)]
    assert untimed == [2] * 5 and g.probing
    assert Machine({2: 1.0, 1: 1.6}).run(g, 2) == [1, 1]  # the probe, on timed steps
    assert g.best == 2 and not g.probing


def test_bf16_units_read_from_the_cpu_flags(tmp_path, monkeypatch):
    """AVX512_BF16 or AMX-BF16 in /proc/cpuinfo's flags (hand-written files in its layout); a
    flag's name inside another (avx512_bf16x) does not count; no file reads as none."""
    head = "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Test CPU\n"
    cases = {
        "fpu sse avx2 avx512f avx512bw avx512_bf16 avx512_vnni": True,
        "fpu sse avx2 amx_tile amx_bf16 amx_int8": True,
        "fpu sse avx2 avx512f avx512_vnni": False,
        "fpu sse avx2 avx512_bf16x": False,
    }
    for flags, want in cases.items():
        f = tmp_path / "cpuinfo"
        f.write_text(f"{head}flags\t\t: {flags}\nbogomips\t: 4000\n")
        assert bf16_units(str(f)) is want, flags
    assert bf16_units(str(tmp_path / "missing")) is False
    # the serving default follows them on a CPU; a GPU serves bf16
    monkeypatch.setattr(cpus, "bf16_units", lambda: True)
    assert serving_dtype("cpu") == "bfloat16" and serving_dtype("cuda:0") == "bfloat16"
    monkeypatch.setattr(cpus, "bf16_units", lambda: False)
    assert serving_dtype("cpu") == "float32" and serving_dtype("cuda") == "bfloat16"
