"""``agent-r1 plan``: a run's memory per GPU from a dry run of the real code on no GPU."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    pl = sub.add_parser(
        "plan",
        help="a run's learner and rollout memory per GPU, from a dry run of the real code on no GPU",
    )
    pl.add_argument(
        "overrides", nargs="*", help="Hydra overrides, e.g. +experiment=qwen3_4b_gsm8k_tool_steppo_4n8g"
    )
    pl.add_argument("--json", action="store_true", help="the plan as JSON instead of the table")
    pl.set_defaults(fn=run)


def run(a: argparse.Namespace) -> int:
    """Exit 0 when the run fits, 1 when it does not (or a stage failed to plan)."""
    from agent_r1.launch.plan import plan, to_json

    p = plan(a.overrides)
    print(to_json(p) if a.json else p.table())
    return 0 if p.fits else 1
