"""The step-level MDP vocabulary shared by environments, flows and the rollout layer.

One step = observation -> action (one whole response) -> env feedback, reward, done;
the environment builds the next observation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agent_r1.rollout.protocol import Completion, FinishReason, GenerateFn, SamplingParams


@dataclass
class Observation:
    """What the policy sees at one step: exactly one of text, chat messages or token ids.

    Each form is the *full* next prompt. ``token_ids`` is the form that keeps earlier tokens
    exactly as sampled; environments that manage their own context produce it directly.
    """

    text: str | None = None
    messages: list[dict[str, Any]] | None = None
    token_ids: list[int] | None = None
    images: list[Any] | None = None

    def __post_init__(self) -> None:
        given = [n for n in ("text", "messages", "token_ids") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(
                f"Observation needs exactly one of text/messages/token_ids, got {given or 'none'}"
            )


@dataclass
class Action:
    """One whole response of the policy, exactly as sampled."""

    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason = FinishReason.STOP
    policy_version: int = 0  # the version that sampled its first token
    # 1 = sampled by the policy; 0 = forced/injected (never trained on). Defaults to all ones.
    mask: list[int] | None = None
    # [[version, tokens], ...] when weight updates interrupted it (``Completion.version_spans``)
    version_spans: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.logprobs) != len(self.token_ids):
            raise ValueError(f"Action: {len(self.token_ids)} token ids but {len(self.logprobs)} logprobs")
        if self.mask is None:
            self.mask = [1] * len(self.token_ids)
        elif len(self.mask) != len(self.token_ids):
            raise ValueError(f"Action: {len(self.token_ids)} token ids but mask of {len(self.mask)}")


@dataclass
class StepResult:
    """What ``AgentEnv.step`` returns."""

    observation: Observation | None  # None when done
    reward: float | None  # None: to be scored by the reward function (terminal step)
    done: bool
    feedback: str = ""  # tool/env feedback text added by this step
    process_reward: list[float | None] = field(default_factory=list)  # one per tool call
    info: dict[str, Any] = field(default_factory=dict)


__all__ = [
    "Action",
    "Completion",
    "FinishReason",
    "GenerateFn",
    "Observation",
    "SamplingParams",
    "StepResult",
]
