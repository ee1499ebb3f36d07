"""``agent-r1 train``: RL training with every role on this machine."""

from __future__ import annotations

import argparse
import sys

from agent_r1.logging import setup_logging


def add_parser(sub: argparse._SubParsersAction) -> None:
    tr = sub.add_parser(
        "train",
        help="RL training, all roles on this machine (Hydra overrides: +experiment=quickstart algorithm=steppo)",
    )
    tr.add_argument(
        "overrides", nargs="*", help="Hydra overrides, e.g. +experiment=quickstart rollout.group_size=4"
    )
    tr.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    tr.set_defaults(fn=run)


def run(a: argparse.Namespace) -> int:
    from agent_r1.train.config import ConfigError, load_config, to_yaml

    setup_logging("launcher")
    try:
        cfg = load_config(a.overrides)
    except ConfigError as e:
        print(f"agent-r1 train: {e}", file=sys.stderr)
        return 2
    if a.print_config:
        print(to_yaml(cfg), end="")
        return 0
    if cfg.cluster.launcher != "local":
        print(
            "agent-r1 train runs locally; use `agent-r1 launch` for cluster.launcher=slurm", file=sys.stderr
        )
        return 2
    from agent_r1.launch.launcher import train_local
    from agent_r1.train.run_dir import RunDirBusy

    try:
        return train_local(cfg)
    except (RunDirBusy, ConfigError) as e:
        print(f"agent-r1 train: {e}", file=sys.stderr)
        return 2
