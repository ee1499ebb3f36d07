"""``agent-r1 data``: a recipe's data rows written to parquet."""

from __future__ import annotations

import argparse
import sys

from agent_r1 import cli_args
from agent_r1.logging import setup_logging


def add_parser(sub: argparse._SubParsersAction) -> None:
    from recipes import RECIPES

    d = sub.add_parser("data", help="write a recipe's data rows to parquet")
    d.add_argument("--recipe", required=True, choices=RECIPES)
    d.add_argument("--split", default="train")
    d.add_argument("--num", type=cli_args.positive_int, default=64)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--out", required=True)
    d.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a recipe option (repeatable; the value read as YAML), as recipe.options in training: "
        "--option task=chain_sum --option min_terms=2",
    )
    d.set_defaults(fn=run)


def options(pairs: list[str]) -> dict:
    """``KEY=VALUE`` pairs as a dict, each value read as YAML (``2`` an int, ``true`` a bool)."""
    import yaml

    out = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"--option {pair!r}: expected KEY=VALUE")
        out[key.strip()] = yaml.safe_load(value)
    return out


def run(a: argparse.Namespace) -> int:
    from agent_r1.data.rows import write_rows
    from recipes import load_recipe

    log = setup_logging("data")
    try:
        rows = load_recipe(a.recipe).build_rows(split=a.split, num=a.num, seed=a.seed, **options(a.option))
    except (KeyError, ValueError, TypeError, FileNotFoundError) as e:  # an unknown recipe, split or option
        print(f"agent-r1 data: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    log.info("wrote %d rows to %s", len(rows), write_rows(rows, a.out))
    return 0
