"""Flags more than one command shares, declared once: the episode settings (from
``EpisodeSettings`` itself), where the policy comes from, and an API key."""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

from agent_r1 import cli_args
from agent_r1.agent.episode import EpisodeSettings

_TYPES = {"temperature": cli_args.nonneg_float, "top_p": cli_args.probability}


def add_episode_flags(p: argparse.ArgumentParser) -> None:
    """``--max-steps --max-obs-tokens --max-action-tokens --temperature --top-p``: each defaults to
    the run's setting (with ``--run``), else to ``EpisodeSettings``' (greedy)."""
    g = p.add_argument_group("episode (default: the run's settings with --run, else the defaults, greedy)")
    for f in fields(EpisodeSettings):
        default = 0.0 if f.name == "temperature" else f.default
        g.add_argument(
            "--" + f.name.replace("_", "-"),
            type=_TYPES.get(f.name, cli_args.positive_int),
            default=None,
            help=f"{f.metadata['help']} (default {default:g})",
        )
    g.add_argument("--seed", type=int, default=None, help="sampling seed (default: the run's, else 0)")


def add_policy_flags(p: argparse.ArgumentParser, many_urls: bool = False) -> None:
    """Where the policy comes from: exactly one of ``--model``, ``--run [--iteration]``, ``--url``;
    without ``--url`` an embedded server is started (``--max-len``, ``--dtype``)."""
    p.add_argument("--model", help="an HF model folder")
    p.add_argument("--run", help="a run directory: its newest (or --iteration) checkpoint and settings")
    p.add_argument(
        "--iteration",
        type=cli_args.nonneg_int,
        default=None,
        help="with --run: this checkpoint",
    )
    p.add_argument(
        "--base",
        action="store_true",
        help="with --run: the model the run started from (model.path), with the run's settings",
    )
    p.add_argument(
        "--url",
        action="append" if many_urls else None,
        help="a running server or sglang-router (needs --tokenizer)"
        + (" (repeat for several)" if many_urls else ""),
    )
    p.add_argument("--tokenizer", help="HF folder of the tokenizer (default: the model's)")
    p.add_argument("--api-key", default=None, help="the server's API key (with --url)")
    p.add_argument(
        "--max-len",
        type=cli_args.positive_int,
        default=None,
        help="the embedded server's context (default: the run's model.max_len, else the episode's budgets)",
    )
    p.add_argument(
        "--dtype", default=None, choices=["float32", "bfloat16"], help="default: the run's, else float32"
    )
    p.add_argument(
        "--strict",
        action="store_true",
        help="with --run: a damaged newest checkpoint is an error (default: the newest intact)",
    )


def add_api_key_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-key", help="require `Authorization: Bearer KEY` on every endpoint but /health")
    p.add_argument("--api-key-file", help="read the API key from this file (keeps it out of `ps`)")


def api_key(a: argparse.Namespace) -> str | None:
    if a.api_key and a.api_key_file:
        raise SystemExit("give --api-key or --api-key-file, not both")
    if a.api_key_file:
        key = Path(a.api_key_file).read_text().strip()
        if not key:
            raise SystemExit(f"--api-key-file {a.api_key_file} is empty")
        return key
    return a.api_key
