#!/usr/bin/env python
"""Final metrics of every task of a sweep, as one table.

python tools/sweep_report.py runs/sweeps/quickstart_lr            # markdown table
python tools/sweep_report.py runs/sweeps/quickstart_lr --csv out.csv
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

COLUMNS = [
    "task",
    "overrides",
    "status",
    "eval_success_start",
    "eval_success_end",
    "iterations",
    "wall_seconds",
]


def rows(sweep_dir: Path) -> list[dict]:
    spec = json.loads((sweep_dir / "sweep.json").read_text())
    out = []
    for t in spec["tasks"]:
        run = sweep_dir / f"task_{t['index']:03d}"
        summary = run / "summary.json"
        row = {"task": t["index"], "overrides": " ".join(t["overrides"])}
        if summary.exists():
            s = json.loads(summary.read_text())
            row.update({k: s.get(k) for k in COLUMNS[3:]})
            row["status"] = "preempted" if s.get("preempted") else "done"
        else:
            row["status"] = "running" if run.exists() else "pending"
        out.append(row)
    return out


def markdown(table: list[dict]) -> str:
    def fmt(v):
        return f"{v:.3f}" if isinstance(v, float) else ("" if v is None else str(v))

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in COLUMNS) + " |" for r in table]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweep_dir")
    ap.add_argument("--csv", help="also write the table as CSV")
    a = ap.parse_args()
    d = Path(a.sweep_dir)
    if not (d / "sweep.json").exists():
        print(f"{d}: no sweep.json (not a sweep directory)", file=sys.stderr)
        return 2
    table = rows(d)
    print(markdown(table))
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            w = csv.DictWriter(f, COLUMNS)
            w.writeheader()
            w.writerows(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
