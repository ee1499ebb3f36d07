"""Smoke runs of the learner and contention benchmarks (``tools/bench``) on small sizes: they run
to their ``BENCH`` lines with the fixed names and baselines. Their speed is not checked."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from agent_r1.cpus import bf16_units

ROOT = Path(__file__).resolve().parents[2]
NUMBER = r"[0-9.]+"


def _bench(*args: str, timeout: int = 600) -> list[str]:
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return [x for x in out.stdout.splitlines() if x.startswith("BENCH ")]


@pytest.mark.slow
def test_the_learner_update_benchmark_runs_against_the_hf_step():
    """The update at quickstart size against ``hf_padded``; on a CPU with bf16 units the bf16 line
    too (elsewhere the benchmark says it skips)."""
    lines = _bench(
        str(ROOT / "tools/bench/learner.py"), "--only", "update", "--sizes", "quickstart", "--repeat", "1"
    )
    want = [
        rf"BENCH learner_update_quickstart seconds={NUMBER} baseline=hf_padded ratio={NUMBER}",
        rf"BENCH learner_update_quickstart_peak_rss mb={NUMBER} baseline=hf_padded ratio={NUMBER}",
    ]
    if bf16_units():
        want.append(rf"BENCH learner_update_quickstart_bf16 seconds={NUMBER} baseline=fp32 ratio={NUMBER}")
    assert len(lines) == len(want), lines
    for line, pattern in zip(lines, want, strict=True):
        assert re.fullmatch(pattern, line), line


@pytest.mark.slow
def test_the_contention_benchmark_runs(tiny_model_dir):
    lines = _bench(str(ROOT / "tools/bench/contention.py"), "--model", str(tiny_model_dir), "--requests", "2")
    names = [x.split()[1] for x in lines]
    assert names[0] == "rollout_uniform_qwen3_neighbour", names
    assert re.fullmatch(
        rf"BENCH rollout_uniform_qwen3_neighbour tok_s={NUMBER} baseline=quiet ratio={NUMBER}", lines[0]
    )
