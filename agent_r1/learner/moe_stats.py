"""What a mixture-of-experts model's routers did during an update, for TensorBoard.

Every training forward of a ``TopKRouter`` adds, per expert, the (token, k) routings it made;
``report`` turns them into each expert's share of all routings (summed over the layers, over the
data-parallel ranks and over the pipeline stages: ``moe/expert_share/eNNN``, summing to 1) and
the worst layer's imbalance (``moe/max_expert_load``: the busiest expert's routings over the
mean; 1.0 is perfectly even), then starts counting afresh. Forwards without gradients (old,
reference logprobs) are not counted: they route the same tokens again.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class RouterStats:
    def __init__(self, modules: list[Any], backend: Any):
        """``modules``: this rank's model chunks (one, or its virtual pipeline stages); ``backend``:
        the learner's ``Backend`` (the device its collectives need)."""
        self.backend = backend
        from megatron.core.transformer.moe.router import TopKRouter

        self.routers = [m for chunk in modules for m in chunk.modules() if isinstance(m, TopKRouter)]
        self.experts = self.routers[0].config.num_moe_experts if self.routers else 0
        self.counts: torch.Tensor | None = None  # (layers, experts), where the routing happens
        for i, router in enumerate(self.routers):
            router.register_forward_hook(lambda mod, args, out, i=i: self._count(i, out))

    def _count(self, layer: int, out: tuple[torch.Tensor, torch.Tensor]) -> None:
        if not torch.is_grad_enabled():
            return
        routed = out[1]  # (tokens, experts) bool: kept on its device (no host sync per layer)
        if self.counts is None:
            self.counts = torch.zeros(
                len(self.routers), self.experts, dtype=torch.float64, device=routed.device
            )
        self.counts[layer] += routed.sum(0)

    def report(self, tp_size: int) -> dict[str, float]:
        """The shares and the imbalance over every rank (a collective: every rank calls it; TP
        peers route the same tokens, so the world's sum is divided by ``tp_size``); on the device
        the backend's collectives need."""
        device = self.backend.collective_device()
        if self.counts is None:  # no training forward since the last report
            self.counts = torch.zeros(len(self.routers), self.experts, dtype=torch.float64, device=device)
        counts = self.counts.to(device)
        per_expert = counts.sum(0)
        worst = (counts.max(1).values / counts.mean(1).clamp_min(1e-9)).max().reshape(1)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(per_expert)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            per_expert = per_expert / tp_size
        self.counts = None
        share = (per_expert / per_expert.sum().clamp_min(1e-9)).cpu()
        out = {f"moe/expert_share/e{e:03d}": float(x) for e, x in enumerate(share.tolist())}
        out["moe/max_expert_load"] = float(worst.cpu()[0])
        return out
