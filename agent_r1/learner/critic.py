"""The critic: the policy's Megatron backbone with a scalar value head, read at each step's start
(its last observation token), trained by (clipped) value regression on the same packed
micro-batches as the policy."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from agent_r1.learner.actor import Actor
from agent_r1.learner.context_parallel import gather_rows
from agent_r1.learner.optim import OptimConfig
from agent_r1.learner.packing import Packed


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
        backend: Any = None,
        adapt_threads: bool = True,
    ):
        self.value_clip = value_clip
        super().__init__(hf_dir, bridge, optim, seed, backend=backend, adapt_threads=adapt_threads)

    def _adapt_hf(self, state: dict[str, torch.Tensor]) -> None:
        """Untied backbone: the head replaces the output layer, the embedding stays."""
        from megatron_bridge import language_config

        self.hf_config = copy.deepcopy(self.hf_config)
        lm = language_config(self.hf_config)  # a vision-language model's language model
        if getattr(lm, "tie_word_embeddings", False):
            lm.tie_word_embeddings = False
            self.hf_config.tie_word_embeddings = False
            state["lm_head.weight"] = state["model.embed_tokens.weight"]

    def _adapt_model(self, module: Any) -> None:
        if module.post_process:
            module.output_layer = ValueHead(module.config.hidden_size, module.config.params_dtype)

    def _rows(self, mb: Packed) -> torch.Tensor:
        return mb.step_value_pos if mb.cp is None else mb.cp.step_rows

    @staticmethod
    def _values(mb: Packed, values: torch.Tensor) -> torch.Tensor:
        """(steps,) fp32 values of the micro-batch (every CP rank's, under context parallelism)."""
        v = values[:, 0].float()
        return v if mb.cp is None else gather_rows(v, mb.cp, steps=True)

    def values(self, micro: list[Packed], num_steps: int) -> torch.Tensor | None:
        """(num_steps,) float32 V(s_t) at every step start of the micro-batches, at their
        ``step_index`` (NaN elsewhere), on the last pipeline stage; None on the others."""
        from megatron.core import parallel_state as ps

        out = torch.full((num_steps,), float("nan"), device=self.device)

        def loss_fn(mb, values):
            v = self._values(mb, values)
            out[mb.step_index] = v
            return v.sum() * 0.0, {}

        self._each("eval")
        with torch.no_grad():
            self._run(micro, loss_fn, forward_only=True)
        return out if ps.is_pipeline_last_stage() else None

    def train_step(
        self,
        micro: list[Packed],
        returns: torch.Tensor | None,
        old_values: torch.Tensor | None = None,
        denom: float | None = None,
    ) -> dict[str, float]:
        """One update of 0.5 (V - R)^2 summed over steps / ``denom`` (default: the steps here),
        PPO-clipped around ``old_values``; ``returns`` / ``old_values`` are flat (S,) over the batch
        (None on stages before the last)."""
        n = denom if denom is not None else float(sum(mb.num_steps for mb in micro))
        nmb = len(micro)
        metrics = {"value_loss": 0.0}

        def loss_fn(mb, values):
            v = self._values(mb, values)
            r = returns[mb.step_index]
            loss = (v - r) ** 2
            if self.value_clip is not None and old_values is not None:
                old = old_values[mb.step_index]
                clipped = old + (v - old).clamp(-self.value_clip, self.value_clip)
                loss = torch.maximum(loss, (clipped - r) ** 2)
            loss = 0.5 * loss.sum() / max(n, 1.0)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"non-finite value loss at critic step {self.steps}")
            metrics["value_loss"] += float(loss.detach())
            return loss * nmb, {}

        metrics.update(self._update(micro, loss_fn))
        return metrics
