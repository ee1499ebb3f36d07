"""gsm8k: a single step (prompt -> response), scored by ``math_number``."""

from agent_r1.agent.flow import AGENTS, AgentSpec, SingleStepFlow
from recipes.gsm8k.data import AGENT

if AGENT not in AGENTS:
    AGENTS.register(AGENT)(AgentSpec(SingleStepFlow))
