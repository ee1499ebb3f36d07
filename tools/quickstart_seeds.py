#!/usr/bin/env python
"""The quickstart over seeds: for each seed k, a tiny model built with seed k, the warm start and
the RL run with seed k (``model.build.seed``, ``sft.seed``, ``trainer.seed`` set together), held-out
success before and after, the warm start's final NLL and the wall time: does the quickstart learn
every time, or only for some seeds?

    python tools/quickstart_seeds.py [--seeds 0-9] [--busy] [--out runs/seeds] [-- extra overrides]

``--busy`` runs a busy loop on one core beside each run (what a shared CI machine does); ``--avx2``
runs an AVX2-only machine's arithmetic on a newer CPU (torch's ``ATEN_CPU_CAPABILITY=avx2``, the
native kernels built with ``-march=haswell``). Prints one
Markdown table row per seed as it finishes, then how many ended at >= 0.8.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def seeds(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def warm_start_nll(run: Path) -> float | None:
    from agent_r1.train.plot import read_scalars

    sft = run / "tensorboard" / "sft"
    if not sft.exists():
        return None
    curve = read_scalars(sft).get("sft/nll", [])
    return curve[-1][1] if curve else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0-9")
    ap.add_argument("--busy", action="store_true", help="a busy loop on one core beside each run")
    ap.add_argument("--avx2", action="store_true", help="torch and the native kernels as on an AVX2-only CPU")
    ap.add_argument("--out", default="runs/seeds")
    ap.add_argument("overrides", nargs="*", help="more Hydra overrides for every run")
    a = ap.parse_args()
    out = Path(a.out)
    print("| seed | held-out before | after | warm-start NLL | wall s |\n|---|---|---|---|---|", flush=True)
    ok = 0
    todo = seeds(a.seeds)
    env = dict(os.environ)
    if a.avx2:
        env.update(ATEN_CPU_CAPABILITY="avx2", AGENT_R1_NATIVE_MARCH="haswell")
    for k in todo:
        run, model = out / f"seed{k}", out / f"tiny-qwen3-seed{k}"
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if a.busy else None
        t0 = time.time()
        try:
            r = subprocess.run(
                [sys.executable, "-m", "agent_r1.cli", "train", "+experiment=quickstart",
                 f"trainer.run_dir={run}", "trainer.progress=false", f"model.path={model}",
                 f"model.build.at={model}", f"model.build.seed={k}", f"sft.seed={k}", f"trainer.seed={k}",
                 *a.overrides],
                capture_output=True, text=True, env=env,
            )  # fmt: skip
        finally:
            if busy is not None:
                busy.kill()
        if r.returncode != 0:
            print(f"| {k} | run failed (exit {r.returncode}): {r.stderr[-300:]!r} | | | |", flush=True)
            continue
        s = json.loads((run / "summary.json").read_text())
        nll = warm_start_nll(run)
        ok += s["eval_success_end"] >= 0.8
        print(f"| {k} | {s['eval_success_start']:.2f} | {s['eval_success_end']:.2f} | "
              f"{'-' if nll is None else f'{nll:.3f}'} | {time.time() - t0:.0f} |", flush=True)  # fmt: skip
    print(f"\n{ok} of {len(todo)} seeds ended at held-out success >= 0.8")


if __name__ == "__main__":
    main()
