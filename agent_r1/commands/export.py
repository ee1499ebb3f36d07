"""``agent-r1 export``: a run's checkpoint (any TP/PP) -> an HF folder with its tokenizer."""

from __future__ import annotations

import argparse
from pathlib import Path

from agent_r1 import cli_args
from agent_r1.logging import setup_logging


def add_parser(sub: argparse._SubParsersAction) -> None:
    ex = sub.add_parser("export", help="a run's checkpoint (any TP/PP) -> an HF folder with its tokenizer")
    ex.add_argument("run_dir")
    ex.add_argument(
        "--iteration", type=cli_args.nonneg_int, default=None, help="default: the newest complete checkpoint"
    )
    ex.add_argument("--out", required=True)
    ex.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    ex.add_argument("--strict", action="store_true", help="a damaged newest checkpoint is an error")
    ex.set_defaults(fn=run)


def run(a: argparse.Namespace) -> int:
    from agent_r1.commands.policy_source import export_checkpoint, newest_checkpoint
    from agent_r1.train.config import from_yaml

    setup_logging("export")
    run = Path(a.run_dir)
    cfg = from_yaml(run / "config.yaml")
    ckpt = newest_checkpoint(run, a.iteration, a.strict)
    out = export_checkpoint(ckpt, Path(cfg.model.path), Path(a.out), a.dtype)
    print(
        f"exported {ckpt} -> {out} ({a.dtype or 'float32'}); serve it: agent-r1 serve --model {out}",
        flush=True,
    )
    return 0
