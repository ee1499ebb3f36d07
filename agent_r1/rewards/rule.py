"""Rule rewards: correctness plus a format component.

score = 1.0 when the extracted answer equals the ground truth; ``format_score`` when an answer was
given in the required format but is wrong; 0.0 when no answer could be found.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agent_r1.registry import Registry
from agent_r1.rewards.answer import extract_answer, normalize_number


@dataclass
class RewardResult:
    score: float
    correct: bool
    formatted: bool
    prediction: str | None = None
    details: dict[str, Any] = field(default_factory=dict)


RewardFn = Callable[..., RewardResult]
REWARDS: Registry[RewardFn] = Registry("reward style")


@REWARDS.register("math_number")
def math_number(
    response: str, ground_truth: str, format_score: float = 0.1, mode: str = "strict"
) -> RewardResult:
    pred = extract_answer(response, mode)
    formatted = pred is not None
    truth = normalize_number(str(ground_truth))
    if truth is None:
        raise ValueError(f"ground_truth {ground_truth!r} is not a number")
    correct = formatted and normalize_number(pred) == truth
    score = 1.0 if correct else (format_score if formatted else 0.0)
    return RewardResult(score, correct, formatted, pred)


REWARDS.register("gsm8k")(math_number)


@REWARDS.register("unscored")
def unscored(response: str, ground_truth: str) -> RewardResult:  # noqa: ARG001
    """Open prompts (batch inference, chat): no ground truth, no reward; 0 and marked unscored."""
    return RewardResult(0.0, False, False, None, {"unscored": True})


@REWARDS.register("env_scored")
def env_scored(response: str, ground_truth: str) -> RewardResult:  # noqa: ARG001
    """The environment scores the episode itself (its last step's reward and ``info.reward``);
    this style is what an unfinished episode falls back to: nothing."""
    return RewardResult(0.0, False, False, None)


def compute_reward(reward_model: dict[str, Any], response: str) -> RewardResult:
    """Score ``response`` by ``reward_model = {"style": ..., "ground_truth": ..., **options}``."""
    opts = {k: v for k, v in reward_model.items() if k not in ("style", "ground_truth")}
    return REWARDS.get(reward_model["style"])(response, reward_model["ground_truth"], **opts)
