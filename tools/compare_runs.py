#!/usr/bin/env python
"""Held-out curves of several runs on one plot, and their before / after table (markdown).

python tools/compare_runs.py runs/hotpotqa_steppo runs/hotpotqa_grpo --metric em \
    --out docs/hotpotqa_curves.png
python tools/compare_runs.py runs/webshop_* --metric success --also score

For each run: the metric (``eval/<metric>``) at iteration 0 (after the warm start) and at the last
evaluation, the held-out steps and tool calls per trajectory at both, and the wall time.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from agent_r1.train.plot import read_scalars


def summarize(run: Path, metric: str, also: list[str] = ()) -> dict:
    s = read_scalars(run / "tensorboard")
    curve = s[f"eval/{metric}"]
    missing = [m for m in also if f"eval/{m}" not in s]
    if missing:
        raise SystemExit(f"{run}: no eval/{missing[0]} in its event files")
    summary = json.loads((run / "summary.json").read_text())
    return {
        "run": run.name,
        "algorithm": summary["algorithm"],
        "curve": curve,
        "before": curve[0][1],
        "after": curve[-1][1],
        "steps": (s["eval/steps_per_trajectory"][0][1], s["eval/steps_per_trajectory"][-1][1]),
        "tool_calls": (s["eval/tool_calls_per_trajectory"][0][1], s["eval/tool_calls_per_trajectory"][-1][1]),
        "wall_s": summary["wall_seconds"],
        "also": {m: (s[f"eval/{m}"][0][1], s[f"eval/{m}"][-1][1]) for m in also},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--metric", default="success", help="eval/<metric>: success, em, f1, recall, ...")
    ap.add_argument(
        "--also", action="append", default=[], help="another eval/<metric> column (before → after)"
    )
    ap.add_argument("--out", help="PNG of the held-out curves")
    a = ap.parse_args()
    rows = [summarize(Path(r), a.metric, a.also) for r in a.runs]
    print(
        f"| run | algorithm | held-out {a.metric} after warm start | after RL | Δ | "
        + "".join(f"{m} | " for m in a.also)
        + "steps / traj | tool calls / traj | wall |"
    )
    print("|---|---|---|---|---|" + "---|" * len(a.also) + "---|---|---|")
    for r in rows:
        print(
            f"| `{r['run']}` | {r['algorithm']} | {r['before']:.3f} | **{r['after']:.3f}** | "
            f"{r['after'] - r['before']:+.3f} | "
            + "".join(f"{b:.3f} → {e:.3f} | " for b, e in r["also"].values())
            + f"{r['steps'][0]:.2f} → {r['steps'][1]:.2f} | "
            f"{r['tool_calls'][0]:.2f} → {r['tool_calls'][1]:.2f} | {r['wall_s']:.0f} s |"
        )
    if a.out:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        for r in rows:
            xs, ys = zip(*r["curve"], strict=True)
            ax.plot(xs, ys, marker="o", label=f"{r['run']} ({r['algorithm']})")
        ax.set_xlabel("iteration")
        ax.set_ylabel(f"held-out {a.metric}")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(a.out, dpi=110)
        print(f"\n{a.out}")


if __name__ == "__main__":
    main()
