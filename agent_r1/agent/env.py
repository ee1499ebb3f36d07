"""AgentEnv: a Gym-like environment whose step is one whole response.

``reset(**row) -> Observation`` starts an episode from a data row; ``async step(action)`` executes
the action and returns the next observation (built by the env), a reward, done and info.
"""

from __future__ import annotations

from typing import Any

from agent_r1.agent.chat import ChatCodec
from agent_r1.agent.types import Action, Observation, StepResult
from agent_r1.agent_tools.services import NO_SERVICES, Services
from agent_r1.registry import Registry


class AgentEnv:
    """Subclass and register with ``@ENVS.register("name")``; a YAML/row string picks it."""

    # the episode's step limit as the flow runs it (``episode.max_steps``), set by the agent loop
    # before ``reset``; None outside a flow. An environment with its own limit ends episodes at the
    # smaller one, so anything it counts "per step left" must count to ``min(own, this)``.
    flow_max_steps: int | None = None

    def __init__(self, codec: ChatCodec, services: Services | None = None, **kwargs: Any):
        if kwargs:
            raise TypeError(f"{type(self).__name__} got unknown options {sorted(kwargs)}")
        self.codec = codec
        self.services = services or NO_SERVICES  # retriever, served models, environment server

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        return []

    def reset(self, **row: Any) -> Observation:
        raise NotImplementedError

    async def step(self, action: Action) -> StepResult:
        raise NotImplementedError

    async def close(self) -> None:
        return None


ENVS: Registry[type[AgentEnv]] = Registry("environment")


def make_env(name: str, codec: ChatCodec, services: Services | None = None, **kwargs: Any) -> AgentEnv:
    return ENVS.get(name)(codec=codec, services=services, **kwargs)
