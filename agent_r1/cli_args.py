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


def positive_int(text: str) -> int:
    """A count: >= 1."""
    x = _int(text)
    if x < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {x}")
    return x


def nonneg_int(text: str) -> int:
    """An index or a number of retries: >= 0."""
    x = _int(text)
    if x < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {x}")
    return x


def port(text: str) -> int:
    """A TCP port; 0 = any free one."""
    x = _int(text)
    if not 0 <= x <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in 0..65535, got {x}")
    return x


def finite_float(text: str) -> float:
    return _float(text)


def nonneg_float(text: str) -> float:
    """A temperature or a weight: finite and >= 0."""
    x = _float(text)
    if x < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {x:g}")
    return x


def probability(text: str) -> float:
    """``top_p``: in (0, 1]."""
    x = _float(text)
    if not 0 < x <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {x:g}")
    return x


def unit_interval(text: str) -> float:
    """A discount or a GAE lambda: in [0, 1]."""
    x = _float(text)
    if not 0 <= x <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {x:g}")
    return x
