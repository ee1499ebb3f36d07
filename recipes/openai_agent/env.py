"""openai_agent: the SDK agent in ``agent.py``, one forked process per episode (its module
imported once per worker), through the gateway."""

from agent_r1.agent.flow import AGENTS, AgentSpec
from agent_r1.gateway.flow import ExternalAgentFlow
from recipes.openai_agent.data import AGENT

if AGENT not in AGENTS:
    AGENTS.register(AGENT)(AgentSpec(ExternalAgentFlow, {"callable": "recipes.openai_agent.agent:solve"}))
