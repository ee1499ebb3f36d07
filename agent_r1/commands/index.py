"""``agent-r1 index build``: a passage corpus -> a retrieval index folder."""

from __future__ import annotations

import argparse
import json

from agent_r1.logging import setup_logging


def add_parser(sub: argparse._SubParsersAction) -> None:
    from recipes import RECIPES

    ix = sub.add_parser("index", help="retrieval indexes for search tools")
    ixs = ix.add_subparsers(dest="index_command", required=True)
    ib = ixs.add_parser("build", help="a passage corpus -> an index folder (bm25s; --dense adds MiniLM)")
    src = ib.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--corpus", help='passages, one JSON per line: {"id", "contents"} or {"id", "title", "text"}'
    )
    src.add_argument("--dataset", nargs="+", help="the passages of HotpotQA / 2Wiki / MuSiQue files")
    src.add_argument("--recipe", choices=RECIPES, help="a recipe's own passages (the offline world)")
    ib.add_argument("--seed", type=int, default=0, help="with --recipe")
    ib.add_argument("--out", required=True)
    ib.add_argument("--dense", action="store_true", help="also the dense MiniLM index")
    ib.set_defaults(fn=run)


def run(a: argparse.Namespace) -> int:
    from agent_r1.retrieval.index import build_index

    setup_logging("index")
    if a.corpus:
        passages, source = a.corpus, a.corpus
    elif a.dataset:
        from recipes.hotpotqa.loaders import DatasetError, dataset_passages

        try:
            passages, source = dataset_passages(a.dataset), " ".join(a.dataset)
        except DatasetError as e:
            raise SystemExit(f"agent-r1 index build: {e}") from None
    else:
        from recipes import load_recipe

        passages, source = (
            load_recipe(a.recipe).passages(seed=a.seed),
            f"recipe {a.recipe} seed {a.seed} (command line)",
        )
    try:
        meta = build_index(passages, a.out, dense=a.dense, source=source)
    except (ValueError, OSError) as e:  # a missing or malformed corpus: named by the reader
        raise SystemExit(f"agent-r1 index build: {e}") from None
    print(json.dumps(meta))
    return 0
