#!/usr/bin/env python
"""Benchmark: streaming rollouts against synchronous and one-step-off training on a long-tail
agentic workload, with the roles on disjoint cores as a cluster has them.

The workload is the ``arithmetic_longtail`` recipe: the quickstart's problems behind a calculator
that is a remote job (it must be polled a row's number of times, each call taking the row's
latency; both Pareto-distributed with a fixed seed), so most episodes take two steps and a few the
step limit and seconds of tool time. Every run starts from the same warm start (made once, then
exported), trains the same number of iterations of the same batches' size with GRPO, and is
measured the same way: step records trained per second of training (the iterations' wall time
without their evaluations), and held-out success at the end. The learner runs on CPU 0, the
rollout server and worker on CPU 1 (``cluster.local_cpus``): in sync mode each side idles while
the other works. Runs are interleaved (sync, one-step-off, stream eta=1, 2, 4; again ...) and the
median of the repeats is reported.

    python tools/bench/stream.py [--iterations 12] [--repeats 3] [--etas 1 2 4] [--sft-steps 1200]

Ends with ``BENCH stream_longtail_eta<k> trained_steps_per_s=... baseline=sync ratio=...`` and
``... baseline=one_step_off ratio=...`` per eta, after one line with each mode's held-out success.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from agent_r1.records.shard import committed_shards, iteration_dirs
from agent_r1.train.plot import read_scalars

WORKLOAD = [
    "+experiment=quickstart",
    "recipe=arithmetic_longtail",
    "episode.max_steps=8",
    "episode.max_obs_tokens=1024",
    "trainer.progress=false",
    "trainer.plot=false",
]


def agent_r1(*args: str) -> None:
    r = subprocess.run([sys.executable, "-m", "agent_r1.cli", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"agent-r1 {' '.join(args[:3])} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")


def warm_start(out: Path, a: argparse.Namespace) -> Path:
    """One warm start (SFT on the noisy demonstrator) for every run, exported as a model folder."""
    run_dir, model = out / "warm", out / "warm_model"
    agent_r1(
        "train", *WORKLOAD, f"trainer.run_dir={run_dir}", "trainer.iterations=0", f"sft.steps={a.sft_steps}"
    )
    agent_r1("export", str(run_dir), "--out", str(model))
    return model


def pinning() -> list[str]:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return []
    learner, rollout = cpus[:1], cpus[1:2]
    return [f"+cluster.local_cpus={{learner: {learner}, server: {rollout}, worker: {rollout}}}"]


def run(name: str, mode: list[str], model: Path, out: Path, a: argparse.Namespace) -> dict:
    run_dir = out / name
    t0 = time.time()
    agent_r1(
        "train",
        *WORKLOAD,
        *mode,
        *pinning(),
        f"trainer.run_dir={run_dir}",
        f"model.path={model}",
        "model.build=null",
        "sft.steps=0",
        f"trainer.iterations={a.iterations}",
        "trainer.eval_every=0",
        "trainer.checkpoint_every=0",
        f"rollout.prompts_per_iteration={a.prompts}",
        f"rollout.group_size={a.group}",
    )
    s = read_scalars(run_dir / "tensorboard")
    other = {k: dict(s.get(k, [])) for k in ("time/eval", "time/checkpoint")}
    train_s = sum(v - other["time/eval"].get(i, 0.0) - other["time/checkpoint"].get(i, 0.0)
                  for i, v in s["time/iteration"])  # fmt: skip
    records = run_dir / "records"
    steps = sum(m.rows for it in iteration_dirs(records) for m in committed_shards(records, it))
    summary = json.loads((run_dir / "summary.json").read_text())
    staleness = [v for _, v in s.get("staleness/max", [])]
    return {
        "steps": steps,
        "train_s": train_s,
        "steps_per_s": steps / train_s,
        "success_end": summary["eval_success_end"],
        "success_start": summary["eval_success_start"],
        "learner_idle_s": statistics.mean(v for _, v in s["time/learner_idle"]),
        "max_staleness": max(staleness, default=0.0),
        "wall_s": time.time() - t0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--etas", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--sft-steps", type=int, default=1200)
    ap.add_argument("--out", help="keep the runs here (default: a temporary folder)")
    ap.add_argument("--warm-model", help="a warm start exported by an earlier run of this benchmark")
    a = ap.parse_args()
    modes = {
        "sync": ["rollout.mode=sync"],
        "one_step_off": ["rollout.mode=async", "rollout.max_staleness=1"],
        **{f"stream_eta{k}": ["rollout.mode=stream", f"rollout.max_staleness={k}"] for k in a.etas},
    }
    with tempfile.TemporaryDirectory(prefix="agent_r1_stream_") as tmp:
        out = Path(a.out or tmp)
        out.mkdir(parents=True, exist_ok=True)
        model = Path(a.warm_model) if a.warm_model else warm_start(out, a)
        results: dict[str, list[dict]] = {m: [] for m in modes}
        for r in range(a.repeats):
            for name, mode in modes.items():
                res = run(f"{name}_r{r}", mode, model, out, a)
                results[name].append(res)
                print(f"{name:14s} repeat {r}: {json.dumps({k: round(v, 3) for k, v in res.items()})}",
                      flush=True)  # fmt: skip
    med = {m: statistics.median(x["steps_per_s"] for x in rs) for m, rs in results.items()}
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "unknown CPU")  # fmt: skip
    print(f"{cpu}, {len(os.sched_getaffinity(0))} CPUs; {a.iterations} iterations x {a.prompts * a.group} "
          f"episodes, median of {a.repeats}")  # fmt: skip
    for m, rs in results.items():
        succ = [x["success_end"] for x in rs]
        print(f"{m:14s} {med[m]:.2f} trained steps/s  held-out success at the end {succ} "
              f"(from {rs[0]['success_start']:.2f}); learner idle {statistics.mean(x['learner_idle_s'] for x in rs):.1f} "
              f"s/iteration; max staleness {max(x['max_staleness'] for x in rs):.0f}")  # fmt: skip
    for k in a.etas:
        m = f"stream_eta{k}"
        for base in ("sync", "one_step_off"):
            print(f"BENCH stream_longtail_eta{k} trained_steps_per_s={med[m]:.3f} baseline={base} "
                  f"ratio={med[m] / med[base]:.2f}")  # fmt: skip
    print("held-out success at the end (median): " + " ".join(
        f"{m}={statistics.median(x['success_end'] for x in rs):.3f}" for m, rs in results.items()))  # fmt: skip


if __name__ == "__main__":
    main()
