"""The learner on the newest megatron-core (0.19.x), beside the venv's 0.16.1: the actor's and the
critic's tests run again in a process whose PYTHONPATH puts the side install
(``tools/contract/build_mcore.sh``: --no-deps, its Python >= 3.12 marker ignored, triton a stand-in)
first. 0.17+ wait on ``torch.cuda.current_stream()`` before every grad sync, which the CPU
compatibility layer answers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_actor_and_critic_pass_on_the_newest_megatron_core():
    side = subprocess.run(
        ["bash", str(ROOT / "tools/contract/build_mcore.sh"), sys.executable],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert side.returncode == 0, side.stderr[-3000:]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / side.stdout.strip()), os.environ.get("PYTHONPATH", "")]),
    }
    probe = subprocess.run([sys.executable, "-c", "import megatron.core as m; print(m.__version__)"],
                           capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert probe.stdout.startswith("0.19."), probe.stderr[-2000:]
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/learner/test_learner_actor.py", "tests/learner/test_learner_critic.py"],
        capture_output=True, text=True, env=env, timeout=1200, cwd=ROOT,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-5000:]
    assert " passed" in r.stdout.splitlines()[-1] and "failed" not in r.stdout.splitlines()[-1]
