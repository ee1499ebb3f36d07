"""Warm-start data: a recipe's demonstrations replayed through its own agent flow.

The demonstrator's turns are "sampled" token for token by a scripted generator, so the
observations (system prompt, tool schemas, tool responses, context management) are exactly what
the environment builds at rollout time; the result is ordinary step records.
"""

from __future__ import annotations

import asyncio
from typing import Any

from agent_r1.agent.chat import ChatCodec
from agent_r1.agent.demonstrations import Demonstrator, Misstep
from agent_r1.agent_tools.services import Services


def demonstration_records(
    recipe: Any,
    rows: list[Any],
    codec: ChatCodec,
    flow: Any,
    seed: int,
    services: Services | None = None,
    **options: Any,
):
    """Step records of the recipe's demonstrations for ``rows`` (``recipe.demonstrations``), their
    environments given ``services`` (the run's); a ``Misstep`` turn's action is masked (not
    imitated)."""
    from agent_r1.agent.run_episodes import run_episodes

    if recipe.demonstrations is None:
        raise ValueError(f"recipe {recipe.name} has no demonstrations(); set sft.steps=0")
    scripts = recipe.demonstrations(rows, seed=seed, **options)
    by_id = {f"sft-p{i}-s0": s for i, s in enumerate(scripts)}
    trajs = asyncio.run(
        run_episodes(
            rows,
            Demonstrator(codec, by_id),
            codec,
            flow,
            1,
            id_prefix="sft",
            progress=False,
            services=services,
        )
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
