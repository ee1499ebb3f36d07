"""Warm-start data: a recipe's demonstrations replayed through its own agent flow.

The demonstrator's turns are "sampled" token for token by a scripted generator, so the
observations (system prompt, tool schemas, tool responses, context management) are exactly what
the environment builds at rollout time; the result is ordinary step records.
"""

from __future__ import annotations

import asyncio
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


def demonstration_records(
    recipe: Any, rows: list[Any], codec: ChatCodec, flow: Any, seed: int, **options: Any
):
    """Step records of the recipe's demonstrations for ``rows`` (``recipe.demonstrations``); a
    ``Misstep`` turn's action is masked (not imitated)."""
    from agent_r1.agent.episodes import run_episodes

    if not hasattr(recipe, "demonstrations"):
        raise ValueError(f"recipe {recipe.__name__} has no demonstrations(); set sft.steps=0")
    scripts = recipe.demonstrations(rows, seed=seed, **options)
    by_id = {f"sft-p{i}-s0": s for i, s in enumerate(scripts)}
    trajs = asyncio.run(
        run_episodes(rows, Demonstrator(codec, by_id), codec, flow, 1, id_prefix="sft", progress=False)
    )
    errors, accepted = [], []
    for t in trajs:
        for s in t.steps:
            refused = [c["error"] for c in s.info.get("tool_calls", []) if c.get("error")]
            if isinstance(by_id[t.trajectory_id][s.step_index], Misstep):
                s.action_mask = [0] * len(s.action_token_ids)
                if not refused:
                    accepted.append((t.trajectory_id, s.step_index))
            elif refused:
                errors.append((t.trajectory_id, refused[0]))
    if accepted:  # a misstep the env took moved its state: the turns after it are not the expert's
        raise RuntimeError(
            f"{len(accepted)} demonstrated missteps were not refused; first, {accepted[0][0]} step {accepted[0][1]}"
        )
    if errors:  # the demonstrator never errs unless meant to: its tools (or their retriever) are broken
        raise RuntimeError(
            f"{len(errors)} tool errors while replaying the demonstrations; first, in {errors[0][0]}: {errors[0][1]}"
        )
    return trajs
