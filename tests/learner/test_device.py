"""Host memory on a CPU learner: large freed blocks are kept for the next step."""

import subprocess
import sys

_FAULTS = """
import resource, sys, torch
if sys.argv[1] == "keep":
    from agent_r1.learner.device import keep_freed_host_memory
    assert keep_freed_host_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):  # a step's large block (64 MiB), written, freed; the first steps
    x = torch.ones(64 << 20, dtype=torch.uint8)
    del x
before = faults()
for _ in range(5):  # the next steps allocate it again
    x = torch.ones(64 << 20, dtype=torch.uint8)
    del x
print(faults() - before)
"""


def _faults(mode: str) -> int:
    r = subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return int(r.stdout.split()[-1])


def test_a_freed_block_is_reused_without_page_faults():
    pages = (64 << 20) // 4096
    default, kept = _faults("default"), _faults("keep")
    assert default > 4 * pages  # glibc's default: mmap'd afresh and zero-filled each time
    assert kept < pages // 4, (kept, default)  # kept: after the first steps, the same pages
