"""Demonstrations: scripted turns replayed through an agent flow as if the policy had sampled
them (the warm start's data, a recipe's tests). A recipe's ``demonstrations`` returns the turns;
``train.sft`` replays them into step records."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from agent_r1.agent.chat import ChatCodec
from agent_r1.rollout.protocol import Completion, FinishReason, SamplingParams


class Misstep(str):
    """A demonstrated turn the environment is meant to refuse (a recovery demonstration: the turns
    after it show what to do once refused). Replayed like any turn, never imitated: its action
    tokens get mask 0, and the replay checks that the environment did refuse it."""


class Demonstrator:
    """A ``generate`` that replies with given texts, one list per trajectory (``session(id)``)."""

    def __init__(self, codec: ChatCodec, scripts: dict[str, list[str]]):
        self.codec, self.scripts = codec, {k: list(v) for k, v in scripts.items()}

    def session(self, trajectory_id: str):
        turns = self.scripts[trajectory_id]

        async def generate(token_ids: list[int], sampling: SamplingParams, images: Any = None) -> Completion:
            if not turns:
                raise RuntimeError(
                    f"demonstration for {trajectory_id} has no turn left (the env wants more steps)"
                )
            ids = self.codec.encode_action(turns.pop(0))  # the calls in this model's format
            reason = FinishReason.STOP
            if len(ids) > sampling.max_new_tokens:
                ids, reason = ids[: sampling.max_new_tokens], FinishReason.LENGTH
            return Completion(ids, [0.0] * len(ids), reason, 0)

        return generate


def noisy_demonstrations(
    rows: list[Any],
    seed: int,
    tool_rate: float,
    with_tool: Callable[[Any], list[str]],
    without_tool: Callable[[Any], list[str]],
) -> list[list[str]]:
    """A noisy demonstrator's turns for each row: ``with_tool(row)`` with probability ``tool_rate``
    (seeded, one draw per row), else ``without_tool(row)``. Imitating it gives a policy that
    sometimes uses the tool; RL has to find out that using it pays."""
    if not 0.0 <= tool_rate <= 1.0:
        raise ValueError(f"tool_rate must be in [0, 1], got {tool_rate}")
    rng = random.Random(seed)
    return [with_tool(row) if rng.random() < tool_rate else without_tool(row) for row in rows]
