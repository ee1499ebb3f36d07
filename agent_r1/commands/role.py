"""``agent-r1 role``: one role of a run (what the launchers and Slurm job steps run)."""

from __future__ import annotations

import argparse

from agent_r1 import cli_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    ro = sub.add_parser("role", help="run one role of a run (used by the launchers and Slurm jobs)")
    ro.add_argument(
        "role",
        help="learner, server, worker, router, retriever, or a helper model's name (teacher, selector, ...)",
    )
    ro.add_argument(
        "--supervise",
        action="store_true",
        help="run the role as a child and restart it when it dies (Slurm steps of rollout roles)",
    )
    ro.add_argument(
        "--max-restarts",
        type=cli_args.nonneg_int,
        default=5,
        help="with --supervise: restarts before giving up",
    )
    ro.add_argument("--run-dir", required=True)
    ro.add_argument(
        "--index", type=cli_args.nonneg_int, default=None, help="server/worker index (default: the task rank)"
    )
    ro.set_defaults(fn=run)


def run(a: argparse.Namespace) -> int:
    from agent_r1.launch.roles import run_role, supervise

    if a.supervise:
        return supervise(a.role, a.run_dir, a.index, a.max_restarts)
    return run_role(a.role, a.run_dir, a.index)
