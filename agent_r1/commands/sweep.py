"""``agent-r1 sweep``: a grid or list of overrides as one Slurm job array; ``sweep-task`` runs one task."""

from __future__ import annotations

import argparse
import sys

from agent_r1.logging import setup_logging


def add_parser(sub: argparse._SubParsersAction) -> None:
    sw = sub.add_parser("sweep", help="a grid or list of overrides as one Slurm job array")
    sw.add_argument("config", help="sweep YAML: name, base, grid | list, max_parallel")
    sw.add_argument("overrides", nargs="*", help="extra overrides for every task")
    sw.add_argument("--dry-run", action="store_true")
    sw.add_argument("--out", help="sweep directory (default runs/sweeps/NAME)")
    sw.set_defaults(fn=sweep)

    st = sub.add_parser("sweep-task", help="one task of a sweep (run by the job array)")
    st.add_argument("sweep_json")
    st.add_argument("index", type=int)
    st.set_defaults(fn=sweep_task)


def sweep(a: argparse.Namespace) -> int:
    from agent_r1.launch.slurm import SlurmError, sweep
    from agent_r1.train.config import ConfigError

    try:
        out = sweep(a.config, a.overrides, dry_run=a.dry_run, out_dir=a.out)
    except (ConfigError, SlurmError) as e:
        print(f"agent-r1 sweep: {e}", file=sys.stderr)
        return 2
    if a.dry_run:
        for t in out["tasks"]:
            print(f"# task {t['index']}: {' '.join(t['overrides'])}")
        print(out["script"], end="")
        if out["tasks"] and "job" in out["tasks"][0]:  # a cluster layout: each task runs its own job body
            print(f"# ---- task_000/job.sh (each task runs its own) ----\n{out['tasks'][0]['job']}", end="")
        return 0
    print(
        f"submitted job array {out['job_id']} ({out['tasks']} tasks)\nsweep dir:   {out['sweep_dir']}\n"
        f"TensorBoard: {out['tensorboard']}\nreport:      {out['report']}"
    )
    return 0


def sweep_task(a: argparse.Namespace) -> int:
    from agent_r1.launch.slurm import sweep_task

    setup_logging("sweep")
    return sweep_task(a.sweep_json, a.index)
