#!/usr/bin/env python
"""Benchmark: seconds per RL iteration of `agent-r1 train` in async mode (generate iteration i+1
while training i, one version of staleness) against sync mode (generate, then train), same model,
same recipe, same batch, in one run. Both runs warm-start identically (a few SFT steps, so the
episodes have realistic lengths) and the first iteration is left out of the mean.

    python tools/bench/trainer.py [--iterations 6 --prompts 16 --group 8 --sft-steps 300]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from agent_r1.train.plot import read_scalars


def run(mode: str, out: Path, a: argparse.Namespace) -> dict:
    run_dir = out / mode
    args = [
        "+experiment=quickstart",
        f"trainer.run_dir={run_dir}",
        f"trainer.iterations={a.iterations}",
        "trainer.eval_every=0",
        "trainer.checkpoint_every=0",
        "trainer.progress=false",
        "trainer.plot=false",
        f"sft.steps={a.sft_steps}",
        f"rollout.prompts_per_iteration={a.prompts}",
        f"rollout.group_size={a.group}",
        f"rollout.mode={mode}",
        "rollout.max_staleness=1",
    ]
    if a.model:
        args += [f"model.path={a.model}"]
    r = subprocess.run([sys.executable, "-m", "agent_r1.cli", "train", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    s = read_scalars(run_dir / "tensorboard")
    per_iter = [v for step, v in s["time/iteration"] if step > 1]
    gen = [v for step, v in s["time/generate"] if step > 1]
    train = [v for step, v in s["time/train"] if step > 1]
    return {
        "iteration_s": statistics.mean(per_iter),
        "generate_wait_s": statistics.mean(gen),
        "train_s": statistics.mean(train),
        "episodes_per_iteration": a.prompts * a.group,
        "summary": json.loads((run_dir / "summary.json").read_text()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--sft-steps", type=int, default=300)
    ap.add_argument("--model", help="HF folder (default: the quickstart's tiny model)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="agent_r1_bench_") as tmp:
        out = Path(tmp)
        sync = run("sync", out, a)
        asyn = run("async", out, a)
    for name, r in (("sync", sync), ("async", asyn)):
        print(
            f"{name:5s}: {r['iteration_s']:.2f} s/iteration (waiting for rollouts {r['generate_wait_s']:.2f} s, "
            f"training {r['train_s']:.2f} s), {r['episodes_per_iteration']} episodes/iteration"
        )
    ratio = sync["iteration_s"] / asyn["iteration_s"]
    print(
        f"BENCH trainer_async_iteration iteration_s={asyn['iteration_s']:.3f} baseline=sync_iteration "
        f"ratio={ratio:.2f}"
    )


if __name__ == "__main__":
    main()
