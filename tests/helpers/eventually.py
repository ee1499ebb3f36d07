"""Waiting for something another process or thread does, without guessing how long it takes: poll
until the condition holds, failing only after a guard far above any real duration."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def eventually(value: Callable[[], T], done: Callable[[T], bool] = bool, guard_s: float = 120.0) -> T:
    """``value()`` polled until ``done(value)`` (truthy by default); the last value either way, so
    the caller's assertion shows what was left when the guard ran out."""
    deadline = time.monotonic() + guard_s
    while True:
        v = value()
        if done(v) or time.monotonic() > deadline:
            return v
        time.sleep(0.05)
