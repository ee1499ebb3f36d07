"""``agent-r1 retriever serve``: an index behind Search-R1's ``/retrieve`` API."""

from __future__ import annotations

import argparse

from agent_r1 import cli_args
from agent_r1.commands.flags import add_api_key_flags, api_key
from agent_r1.logging import setup_logging


def add_parser(sub: argparse._SubParsersAction) -> None:
    rv = sub.add_parser("retriever", help="serve an index over HTTP (Search-R1's /retrieve API)")
    rvs = rv.add_subparsers(dest="retriever_command", required=True)
    rs = rvs.add_parser("serve")
    rs.add_argument("--index", required=True)
    rs.add_argument("--host", default="127.0.0.1")
    rs.add_argument("--port", type=cli_args.port, default=8000)
    rs.add_argument("--mode", default="sparse", choices=["sparse", "dense", "hybrid"])
    rs.add_argument("--ready-file", default=None, help='written with {"url"} once serving')
    add_api_key_flags(rs)
    rs.set_defaults(fn=run)


def run(a: argparse.Namespace) -> int:
    from agent_r1.retrieval.server import serve_retriever

    setup_logging("retriever")
    return serve_retriever(a.index, a.host, a.port, a.ready_file, api_key(a), a.mode)
