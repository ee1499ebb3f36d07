"""Cross-rank reductions behind one small interface, passed explicitly to algorithms.

``LocalReducer`` (one process), ``TorchReducer`` (a torch.distributed group: gloo or NCCL, used
by learners) and ``MPIReducer`` (mpi4py, used by the standalone record-processing CLI).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch


class Reducer(Protocol):
    def allreduce_sum(self, t: torch.Tensor) -> torch.Tensor: ...

    def allgather_cat(self, t: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``t`` along dim 0 (sizes may differ), in rank order."""
        ...


class LocalReducer:
    def allreduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def allgather_cat(self, t: torch.Tensor) -> torch.Tensor:
        return t


class TorchReducer:
    """Collectives over a torch.distributed group. NCCL moves CUDA tensors only, gloo CPU ones:
    each collective runs on ``device`` (default: the current CUDA device for an NCCL group, the
    CPU otherwise) and its result comes back on the input's device."""

    def __init__(self, group: Any = None, device: torch.device | None = None):
        import torch.distributed as dist

        self.dist, self.group = dist, group
        self.world = dist.get_world_size(group)
        if device is None:
            nccl = dist.get_backend(group) == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self.device = device

    def allreduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        x = t.to(self.device, copy=True)
        self.dist.all_reduce(x, op=self.dist.ReduceOp.SUM, group=self.group)
        return x.to(t.device)

    def allgather_cat(self, t: torch.Tensor) -> torch.Tensor:
        n = torch.tensor([t.shape[0]], dtype=torch.int64, device=self.device)
        sizes = [torch.zeros_like(n) for _ in range(self.world)]
        self.dist.all_gather(sizes, n, group=self.group)
        counts = [int(s) for s in torch.cat(sizes).tolist()]
        padded = torch.zeros((max(counts), *t.shape[1:]), dtype=t.dtype, device=self.device)
        padded[: t.shape[0]] = t
        out = [torch.zeros_like(padded) for _ in range(self.world)]
        self.dist.all_gather(out, padded, group=self.group)
        return torch.cat([o[:c] for o, c in zip(out, counts, strict=True)]).to(t.device)


class MPIReducer:
    def __init__(self, comm: Any = None):
        if comm is None:
            from mpi4py import MPI

            comm = MPI.COMM_WORLD
        self.comm = comm

    def allreduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        from mpi4py import MPI

        src = np.ascontiguousarray(t.numpy())
        dst = np.empty_like(src)
        self.comm.Allreduce(src, dst, op=MPI.SUM)
        return torch.from_numpy(dst)

    def allgather_cat(self, t: torch.Tensor) -> torch.Tensor:
        parts = self.comm.allgather(np.ascontiguousarray(t.numpy()))
        return torch.from_numpy(np.concatenate(parts))
