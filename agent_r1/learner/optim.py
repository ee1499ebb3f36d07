"""The learner's optimizer slice of the config (``optim.*``): Adam through Megatron's optimizer,
warmup + cosine decay, gradient clipping, and the packed micro-batch token budget."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass
class OptimConfig:
    """``optim.*``; also what the critic (at ``algorithm.critic_lr``) and the warm start use."""

    lr: float = 1e-5
    min_lr: float = 0.0
    warmup_steps: int = 0
    decay_steps: int = 1000  # lr decays (cosine) to min_lr over this many optimizer steps
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    micro_tokens: int = 4096  # packed tokens per micro-batch
    # each micro-batch's token stream padded to a multiple of this (masked padding: never trained
    # on, in no denominator); 0 = automatic: 16 with model.precision=fp8 (Transformer Engine's FP8
    # GEMMs need dimensions divisible by 16), else none
    pad_multiple: int = 0
    distributed_optimizer: bool = True
    # a trajectory whose first observation starts with at least this many tokens of another's in
    # its micro-batch (its group's prompt, a shared system prompt) shares those rows instead of
    # repeating them: fewer tokens through every layer (the local layer spec; 0 = off)
    share_prefix: int = 0

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"optim.lr must be > 0 and 0 <= min_lr <= lr, got {self.lr}, {self.min_lr}")
        if self.micro_tokens < 1:
            raise ValueError(f"optim.micro_tokens must be >= 1, got {self.micro_tokens}")
        if self.share_prefix < 0:
            raise ValueError(f"optim.share_prefix must be >= 0 (0 = off), got {self.share_prefix}")
        if self.pad_multiple < 0:
            raise ValueError(f"optim.pad_multiple must be >= 0 (0 = automatic), got {self.pad_multiple}")


FP8_ALIGNMENT = 16  # Transformer Engine: FP8 GEMM dimensions must be multiples of 16


def pad_multiple(optim: OptimConfig, precision: str, sequence_split: int = 1) -> int:
    """The multiple every micro-batch's stream is padded to: ``optim.pad_multiple`` (0: 16 for
    FP8, else 1), times what it lacks of ``sequence_split`` (sequence parallelism gives each of
    the tp ranks an equal slice of the stream)."""
    base = optim.pad_multiple or (FP8_ALIGNMENT if precision == "fp8" else 1)
    return math.lcm(base, sequence_split)


def torch_optimizers(megatron_optimizer: Any) -> list[Any]:
    """The torch optimizers inside a Megatron optimizer (chained or not)."""
    chained = getattr(megatron_optimizer, "chained_optimizers", [megatron_optimizer])
    return [c.optimizer for c in chained if getattr(c, "optimizer", None) is not None]


def use_fused_adam(megatron_optimizer: Any) -> int:
    """Make the torch Adam/AdamW inside a Megatron optimizer run its fused kernel (one pass over
    each parameter) where torch has one for the parameters' device. Megatron builds torch's Adam
    when neither Transformer Engine nor Apex is installed (always on CPU), and torch's default on
    CPU is the per-tensor loop: about ten elementwise passes over every parameter per step (at
    SmolLM2 size ~2 s of a ~12 s update on 2 cores). Same update rule; returns how many param
    groups were switched."""
    import torch
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    switched = 0
    for torch_opt in torch_optimizers(megatron_optimizer):
        if type(torch_opt) not in (torch.optim.Adam, torch.optim.AdamW):
            continue  # TE's / Apex's FusedAdam already is one kernel
        for group in torch_opt.param_groups:
            params = group["params"]
            if not params or group.get("fused") or group.get("capturable") or group.get("differentiable"):
                continue
            devices = {p.device.type for p in params}
            if devices <= set(_get_fused_kernels_supported_devices()) and all(
                p.dtype.is_floating_point for p in params
            ):
                group["fused"], group["foreach"] = True, False
                switched += 1
    return switched
