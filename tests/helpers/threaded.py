"""Run k in-process "ranks" as threads with a Reducer built on a barrier.

It does what a collective does (every rank contributes, every rank gets the combined result), so
sharding invariance can be property-tested quickly; real gloo and MPI runs are tested separately.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch


class _Hub:
    def __init__(self, world: int):
        self.world = world
        self.barrier = threading.Barrier(world)
        self.slots: list[Any] = [None] * world


class ThreadReducer:
    def __init__(self, hub: _Hub, rank: int):
        self.hub, self.rank = hub, rank

    def _exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        self.hub.slots[self.rank] = t.clone()
        self.hub.barrier.wait()
        parts = list(self.hub.slots)
        self.hub.barrier.wait()
        return parts

    def allreduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(t)
        out = parts[0].clone()
        for p in parts[1:]:
            out = out + p
        return out

    def allgather_cat(self, t: torch.Tensor) -> torch.Tensor:
        return torch.cat(self._exchange(t))


def run_ranks(world: int, fn: Callable[[int, ThreadReducer], Any]) -> list[Any]:
    hub = _Hub(world)
    results: list[Any] = [None] * world
    errors: list[BaseException] = []

    def target(r: int) -> None:
        try:
            results[r] = fn(r, ThreadReducer(hub, r))
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors.append(e)
            hub.barrier.abort()

    threads = [threading.Thread(target=target, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results
