"""What a learner rank runs on, chosen once and passed down: ``Backend``.

Three kinds. A GPU (``cuda``): Megatron-Core as upstream runs it (Transformer Engine where it is
installed). The CPU (``cpu``): Megatron-Core with the adaptations of this package — ``cpu_compat``
(CUDA calls answered on the host, gloo), native kernels for the work Megatron leaves unfused
(``norm``, ``rope``, ``activation``: RMSNorm, RoPE, SwiGLU) and the bf16 gradient add
(``main_grad``). A plan (``meta``): ``agent-r1 plan``'s dry run of a GPU rank (``dry_run``: meta
tensors, a fake process group, memory counted), planning either the GPU's fused kernels
(``fused_plan``) or exactly what a CPU learner runs.

The learner asks its ``Backend`` where tensors live, which device a collective needs, how the
algorithms reduce across ranks and which micro-batches a schedule runs; nothing reads a
process-wide flag for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from agent_r1.cpus import keep_freed_blocks

if TYPE_CHECKING:
    from agent_r1.learner.backend.dry_run import DryRun

OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}


@dataclass(frozen=True)
class Backend:
    device: torch.device  # where the learner's tensors live: this rank's GPU, the CPU, or meta (a plan)
    plan: DryRun | None = None  # agent-r1 plan's dry run of a GPU rank (None: a real run)

    @staticmethod
    def here() -> Backend:
        """This process's: its current GPU when CUDA is available, else the CPU."""
        if torch.cuda.is_available():
            return Backend(torch.device("cuda", torch.cuda.current_device()))
        return Backend(torch.device("cpu"))

    @staticmethod
    def planning(run: DryRun) -> Backend:
        """A dry run's: tensors on its planned (meta) device."""
        from agent_r1.learner.backend.dry_run import DEVICE

        return Backend(DEVICE, run)

    @property
    def builds_for_gpu(self) -> bool:
        """The model is built as on a GPU (a real GPU, or a plan of one)."""
        return self.device.type == "cuda" or self.plan is not None

    @property
    def fused_plan(self) -> bool:
        """A plan of the GPU's fused kernels (Transformer Engine's attention, norm and RoPE) in place
        of the local spec's composite ones: the CPU kernels are not routed in."""
        return self.plan is not None and self.plan.fused_kernels

    def collective_device(self, group: Any = None) -> torch.device:
        """The device a collective on ``group`` needs its tensors on: CUDA for NCCL, CPU otherwise
        (in a plan: as the planned run's backend would need)."""
        backend = self.plan.backend if self.plan is not None else dist.get_backend(group)
        return self.device if backend == "nccl" else torch.device("cpu")

    def reducer(self, group: Any = None) -> Any:
        """The algorithms' cross-rank reductions over ``group``, on the device its backend needs (a
        plan's: collectives checked, every rank taken to hold this rank's values)."""
        from agent_r1.algos.reduce import TorchReducer

        if self.plan is not None:
            from agent_r1.learner.backend.dry_run import Reducer

            return Reducer(group, self.collective_device(group))
        return TorchReducer(group, self.collective_device(group))

    def all_reduce_scalar(
        self, value: float, op: str = "sum", group: Any = None, dtype=torch.float64
    ) -> float:
        """``value`` reduced over ``group`` (sum, min or max) through a tensor on the right device."""
        t = torch.tensor([value], dtype=dtype, device=self.collective_device(group))
        dist.all_reduce(t, op=OPS[op], group=group)
        if self.plan is not None:  # a fake group: every rank is taken to hold this rank's value
            return value
        return t.item()

    def schedule(self, micro: list[Any]) -> list[Any]:
        """The micro-batches a forward-backward schedule runs: every one, except in a plan (its
        ``schedule_limit`` largest)."""
        return micro if self.plan is None else self.plan.schedule(micro)

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A pushed tensor in host memory (in a plan: the planned one, no longer counted)."""
        if self.plan is not None:
            self.plan.memory.untrack([t])
            return t
        return t.detach().cpu()


def bind_local_gpu(local_rank: int) -> None:
    """Make GPU ``local_rank`` this process's current device (no-op without CUDA)."""
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())


def keep_freed_host_memory() -> bool:
    """On a CPU learner, let glibc's malloc keep large freed blocks for reuse
    (``cpus.keep_freed_blocks``): a learner step allocates and frees its activations and gradients
    (hundreds of MB at SmolLM2 size) every time and otherwise pays their page faults on every step
    (~12 % of the update measured at that size). No-op on a GPU learner; returns whether it applied."""
    if torch.cuda.is_available():
        return False
    return keep_freed_blocks()
