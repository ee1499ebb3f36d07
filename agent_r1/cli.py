"""``agent-r1``: the single entry point; each command lives in its own module of ``commands/``."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import NoReturn

from agent_r1.commands import COMMANDS
from agent_r1.errors import expected_failure, one_line


class Parser(argparse.ArgumentParser):
    """A usage error is one line (and where to read more), not the whole usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="agent-r1", description="Slurm-native end-to-end RL for multi-step LLM agents.")
    p.add_argument(
        "--debug",
        action="store_true",
        help="a traceback for every failure (default: one line for expected ones)",
    )
    sub = p.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"agent_r1.commands.{name}").add_parser(sub)
    return p


def _stdout_closed() -> bool:
    """True when standard output is a pipe whose reader has gone (``agent-r1 ... | head``)."""
    import select

    try:
        p = select.poll()
        p.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in p.poll(0))
    except (OSError, ValueError):
        return False


def main(argv: list[str] | None = None) -> int:
    # SIGPIPE stays ignored (Python's default): a server writing to a client that hung up must get
    # EPIPE as an exception, not die of the signal. A closed stdout pipe ends the command quietly.
    parser = build_parser()
    a, extra = parser.parse_known_args(argv)
    if extra and isinstance(getattr(a, "overrides", None), list) and all("=" in x for x in extra):
        a.overrides += extra  # Hydra overrides after an option: `train --print-config a=b`
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return a.fn(a)
    except BrokenPipeError:
        if not _stdout_closed():
            raise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 141  # as a shell reports a process ended by SIGPIPE (128 + 13)
    except Exception as e:  # the one error path: an expected failure is one line, a bug a traceback
        code = expected_failure(e)
        if code is None or a.debug:
            raise
        print(f"{command_name(a)}: {one_line(e)}", file=sys.stderr, flush=True)
        return code


def command_name(a: argparse.Namespace) -> str:
    """``agent-r1 records stats``: the words the user typed to pick the command."""
    words = [
        a.command,
        *(
            getattr(a, k, None)
            for k in ("records_command", "index_command", "env_command", "retriever_command")
        ),
    ]
    return " ".join(["agent-r1", *(w for w in words if w)])


if __name__ == "__main__":
    sys.exit(main())
