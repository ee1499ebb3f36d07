"""``agent-r1 env serve``: a recipe's environment (e.g. WebShop) as an HTTP service."""

from __future__ import annotations

import argparse

from agent_r1 import cli_args
from agent_r1.commands.flags import add_api_key_flags, api_key
from agent_r1.logging import setup_logging


def add_parser(sub: argparse._SubParsersAction) -> None:
    en = sub.add_parser("env", help="a recipe's environment as a service")
    ens = en.add_subparsers(dest="env_command", required=True)
    es = ens.add_parser("serve", help="serve a recipe's environment (e.g. webshop) over HTTP")
    es.add_argument("recipe")
    es.add_argument("--host", default="127.0.0.1")
    es.add_argument("--port", type=cli_args.port, default=0, help="0 = any free port")
    es.add_argument("--ready-file", default=None, help='written with {"url"} once serving')
    es.add_argument("--data", default=None, help="the recipe's data folder (webshop: WebShop's files)")
    es.add_argument("--human", action="store_true", help="webshop: the human instructions")
    es.add_argument("--seed", type=int, default=0)
    add_api_key_flags(es)
    es.set_defaults(fn=run)


def run(a: argparse.Namespace) -> int:
    from agent_r1.train.env_server import recipe_server

    setup_logging("env")
    try:
        server = recipe_server(a.recipe)
    except ValueError as e:
        raise SystemExit(f"agent-r1 env serve: {e}") from None
    options = {k: v for k, v in (("data", a.data), ("human", a.human)) if v}
    return server.serve(a.host, a.port, a.ready_file, api_key(a), None, seed=a.seed, **options)
