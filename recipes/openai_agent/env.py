"""openai_agent: the SDK agent in ``agent.py`` (or its twins: ``agents_sdk.py`` with the OpenAI
Agents SDK, ``plain_http.py`` with no SDK), one forked process per episode (its module imported
once per worker), through the gateway."""

from agent_r1.agent.flow import AGENTS, AgentSpec
from agent_r1.gateway.program_flow import ExternalAgentFlow
from recipes.openai_agent.data import AGENT, AGENTS_SDK, PLAIN_HTTP

for name, spec in (
    (AGENT, "recipes.openai_agent.agent:solve"),
    (AGENTS_SDK, "recipes.openai_agent.agents_sdk:solve"),
    (PLAIN_HTTP, "recipes.openai_agent.plain_http:solve"),
):
    if name not in AGENTS:
        AGENTS.register(name)(AgentSpec(ExternalAgentFlow, {"callable": spec}))
