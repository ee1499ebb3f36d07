"""The learner's optimizer slice of the config (``optim.*``): Adam through Megatron's optimizer,
warmup + cosine decay, gradient clipping, and the packed micro-batch token budget."""

from __future__ import annotations

from dataclasses import dataclass


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
    distributed_optimizer: bool = True

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"optim.lr must be > 0 and 0 <= min_lr <= lr, got {self.lr}, {self.min_lr}")
        if self.micro_tokens < 1:
            raise ValueError(f"optim.micro_tokens must be >= 1, got {self.micro_tokens}")
