"""``agent-r1 launch``: a run submitted to Slurm as one heterogeneous job."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    la = sub.add_parser("launch", help="submit a run to Slurm as one heterogeneous job (--dry-run prints it)")
    la.add_argument(
        "overrides", nargs="*", help="Hydra overrides, e.g. +experiment=qwen3_4b_gsm8k_tool_steppo_4n8g"
    )
    la.add_argument("--dry-run", action="store_true", help="print the sbatch script, submit nothing")
    la.add_argument(
        "--no-plan", action="store_true", help="submit without the memory plan (`agent-r1 plan`) of a GPU run"
    )
    la.set_defaults(fn=run)


def run(a: argparse.Namespace) -> int:
    from agent_r1.launch.plan import PlanError
    from agent_r1.launch.slurm import SlurmError, launch
    from agent_r1.train.config import ConfigError
    from agent_r1.train.run_dir import RunDirBusy

    try:
        out = launch(a.overrides, dry_run=a.dry_run, plan=not a.no_plan)
    except (ConfigError, SlurmError, RunDirBusy, PlanError) as e:
        print(f"agent-r1 launch: {e}", file=sys.stderr)
        return 2
    if a.dry_run:
        print(out["script"], end="")
        return 0
    print(
        f"submitted job {out['job_id']}\nrun dir:     {out['run_dir']}\nscript:      {out['script']}\n"
        f"logs:        {' '.join(out['logs'])}\nTensorBoard: {out['tensorboard']}\n"
        f"watch:       squeue -j {out['job_id']}; tail -f {out['logs'][0]}"
    )
    return 0
