"""Where the learner's tensors live: this rank's GPU when there is one, else the CPU.

Each learner rank binds its GPU from its local rank before anything touches CUDA
(``bind_local_gpu``); every tensor the learner makes is then created on ``learner_device()``, and
every collective takes tensors on ``collective_device(group)`` (NCCL only moves CUDA tensors,
gloo CPU ones), so nothing moves between host and device implicitly.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from agent_r1.cpus import keep_freed_blocks


def bind_local_gpu(local_rank: int) -> torch.device:
    """Make GPU ``local_rank`` this process's current device (no-op without CUDA)."""
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    return learner_device()


def learner_device() -> torch.device:
    """The current CUDA device when CUDA is available, the planned device in a dry run
    (``learner.dry_run``), else the CPU."""
    from agent_r1.learner import dry_run

    if dry_run.active() is not None:
        return dry_run.DEVICE
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def collective_device(group: Any = None) -> torch.device:
    """The device a collective on ``group`` needs its tensors on: CUDA for NCCL, CPU otherwise
    (in a dry run: as the planned run's backend would need)."""
    from agent_r1.learner import dry_run

    run = dry_run.active()
    backend = run.backend if run is not None else dist.get_backend(group)
    return learner_device() if backend == "nccl" else torch.device("cpu")


def reducer(group: Any = None) -> Any:
    """The algorithms' cross-rank reductions over ``group``, on the device its backend needs (a dry
    run's: collectives checked, every rank taken to hold this rank's values)."""
    from agent_r1.algos.reduce import TorchReducer
    from agent_r1.learner import dry_run

    if dry_run.active() is not None:
        return dry_run.Reducer(group, collective_device(group))
    return TorchReducer(group, collective_device(group))


def all_reduce_scalar(value: float, op: str = "sum", group: Any = None, dtype=torch.float64) -> float:
    """``value`` reduced over ``group`` (sum, min or max) through a tensor on the right device."""
    from agent_r1.learner import dry_run

    t = torch.tensor([value], dtype=dtype, device=collective_device(group))
    dist.all_reduce(
        t, op={"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op], group=group
    )
    if dry_run.active() is not None:  # a fake group: every rank is taken to hold this rank's value
        return value
    return t.item()


def keep_freed_host_memory() -> bool:
    """On a CPU learner, let glibc's malloc keep large freed blocks for reuse
    (``cpus.keep_freed_blocks``): a learner step allocates and frees its activations and gradients
    (hundreds of MB at SmolLM2 size) every time and otherwise pays their page faults on every step
    (~12 % of the update measured at that size). No-op on a GPU learner; returns whether it applied."""
    if torch.cuda.is_available():
        return False
    return keep_freed_blocks()
