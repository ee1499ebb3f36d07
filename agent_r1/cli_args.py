"""Argument types for the command line: a value out of range is refused by argparse (exit 2, one
line naming the flag) before anything starts."""

from __future__ import annotations

import argparse
import math


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def _float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(x):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return x


def _ranged(parse, ok, want: str, doc: str):
    def check(text: str):
        x = parse(text)
        if not ok(x):
            raise argparse.ArgumentTypeError(f"must be {want}, got {x:g}")
        return x

    check.__doc__ = doc
    return check


positive_int = _ranged(_int, lambda x: x >= 1, ">= 1", "A count: >= 1.")
nonneg_int = _ranged(_int, lambda x: x >= 0, ">= 0", "An index or a number of retries: >= 0.")
port = _ranged(_int, lambda x: 0 <= x <= 65535, "a port in 0..65535", "A TCP port; 0 = any free one.")
finite_float = _ranged(_float, lambda x: True, "finite", "Any finite number.")
nonneg_float = _ranged(_float, lambda x: x >= 0, ">= 0", "A temperature or a weight: finite and >= 0.")
probability = _ranged(_float, lambda x: 0 < x <= 1, "in (0, 1]", "``top_p``: in (0, 1].")
unit_interval = _ranged(_float, lambda x: 0 <= x <= 1, "in [0, 1]", "A discount or a GAE lambda: in [0, 1].")
