"""openai_agent: the SDK agent in ``agent.py`` (or the Agents SDK one in ``agents_sdk.py``), one
forked process per episode (its module imported once per worker), through the gateway."""

from agent_r1.agent.flow import AGENTS, AgentSpec
from agent_r1.gateway.flow import ExternalAgentFlow
from recipes.openai_agent.data import AGENT, AGENTS_SDK

for name, spec in (
    (AGENT, "recipes.openai_agent.agent:solve"),
    (AGENTS_SDK, "recipes.openai_agent.agents_sdk:solve"),
):
    if name not in AGENTS:
        AGENTS.register(name)(AgentSpec(ExternalAgentFlow, {"callable": spec}))
