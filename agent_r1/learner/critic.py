"""The critic: the same Megatron backbone with a scalar value head, read at each step's start (the
last observation token), trained by (clipped) value regression on prefix-merged packed streams.
Also ``ReferencePolicy``: a frozen copy of the initial policy for the KL term."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from agent_r1.learner.actor import Actor, OptimConfig, _global_rows, _step_offsets
from agent_r1.learner.packing import pack_micro_batches


class ValueHead(torch.nn.Module):
    """Replaces GPTModel.output_layer: hidden (S, B, H) -> values (S, B, 1), replicated over TP."""

    def __init__(self, hidden: int, dtype: torch.dtype):
        super().__init__()
        # named like the layer it replaces (output_layer.weight/.bias), so Megatron's checkpointing
        # of the language model finds them
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype))

    def forward(self, hidden: torch.Tensor, weight: Any = None, **kwargs: Any):
        return torch.nn.functional.linear(hidden, self.weight, self.bias), None


class Critic(Actor):
    def __init__(
        self,
        hf_dir: str | Path,
        bridge: Any,
        optim: OptimConfig,
        seed: int = 0,
        value_clip: float | None = 0.2,
    ):
        self.value_clip = value_clip
        super().__init__(hf_dir, bridge, optim, seed, value_head=True)

    def values(self, trajectories: list[list[dict]]) -> list[float] | None:
        """V(s_t) at every step start (last pipeline stage; None elsewhere)."""
        micro = pack_micro_batches(trajectories, self.optim_cfg.micro_tokens)
        starts = _step_offsets(trajectories)
        out: dict[int, float] = {}

        def loss_fn(members, mb, values):
            v = values[mb.step_value_pos, 0]
            for row, val in zip(
                _global_rows(members, trajectories, starts).tolist(), v.tolist(), strict=True
            ):
                out[row] = val
            return v.sum() * 0.0, {}

        self.model.eval()
        with torch.no_grad():
            self._run(micro, loss_fn, forward_only=True)
        from megatron.core import parallel_state as ps

        return [out[i] for i in range(len(out))] if ps.is_pipeline_last_stage() else None

    def train_step(
        self, trajectories: list[list[dict]], returns: list[float], old_values: list[float] | None = None
    ) -> dict[str, float]:
        """One update of 0.5 (V - R)^2 averaged over steps (PPO value clipping around old values)."""
        micro = pack_micro_batches(trajectories, self.optim_cfg.micro_tokens)
        starts = _step_offsets(trajectories)
        n_steps = sum(len(t) for t in trajectories)
        nmb = len(micro)
        metrics = {"value_loss": 0.0}

        def loss_fn(members, mb, values):
            rows = _global_rows(members, trajectories, starts)
            v = values[mb.step_value_pos, 0].float()
            r = torch.tensor(returns, dtype=torch.float32)[rows]
            loss = (v - r) ** 2
            if self.value_clip is not None and old_values is not None:
                old = torch.tensor(old_values, dtype=torch.float32)[rows]
                clipped = old + (v - old).clamp(-self.value_clip, self.value_clip)
                loss = torch.maximum(loss, (clipped - r) ** 2)
            loss = 0.5 * loss.sum() / n_steps
            if not torch.isfinite(loss):
                raise FloatingPointError(f"non-finite value loss at critic step {self.steps}")
            metrics["value_loss"] += float(loss.detach())
            return loss * nmb, {}

        metrics.update(self._update(micro, loss_fn))
        return metrics
