"""reasoning_gym: one step (prompt -> answer), or with the calculator up to 5 steps; scored by the
task's own ``score_answer`` on the answer in ``<answer>`` tags (reward style ``reasoning_gym``)."""

from __future__ import annotations

import functools
import json

from agent_r1.agent.flow import AGENTS, AgentEnvLoop, AgentSpec, SingleStepFlow
from agent_r1.rewards import REWARDS, RewardResult
from recipes.reasoning_gym.data import AGENT, AGENT_TOOL, _rg

if AGENT not in AGENTS:
    AGENTS.register(AGENT)(AgentSpec(SingleStepFlow))
if AGENT_TOOL not in AGENTS:
    AGENTS.register(AGENT_TOOL)(
        AgentSpec(
            AgentEnvLoop, {"env": "tool", "tools": ["calculator"], "max_steps": 5, "error_penalty": 0.1}
        )
    )


@functools.cache
def _scorer(task: str):
    return _rg().get_score_answer_fn(task)


if "reasoning_gym" not in REWARDS:

    @REWARDS.register("reasoning_gym")
    def reasoning_gym_reward(response: str, ground_truth: str) -> RewardResult:
        """reasoning-gym's ``extract_answer`` (the last ``<answer>...</answer>``), then the task's
        ``score_answer(answer, item)`` (``ground_truth``: the task and the item, as JSON): 1.0
        right, partial credit where the task gives it, 0 with no answer."""
        try:
            truth = json.loads(ground_truth)
            task, item = truth["task"], truth["item"]
        except (ValueError, TypeError, KeyError):
            raise ValueError(
                f"reasoning_gym reward: ground_truth must be JSON {{'task', 'item'}}, got {ground_truth[:120]!r}"
            ) from None
        pred = _rg().utils.extract_answer(response)
        if pred is None:
            return RewardResult(0.0, False, False, None)
        score = float(_scorer(task)(pred, item))
        return RewardResult(score, score >= 1.0, True, pred)
