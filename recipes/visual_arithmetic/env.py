"""visual_arithmetic: ToolEnv with the calculator; the prompt's image is part of the observation."""

from agent_r1.agent.flow import AGENTS, AgentEnvLoop, AgentSpec
from recipes.visual_arithmetic.data import AGENT, SYSTEM

if AGENT not in AGENTS:
    AGENTS.register(AGENT)(
        AgentSpec(
            AgentEnvLoop, {"env": "tool", "tools": ["calculator"], "max_steps": 4, "system_prompt": SYSTEM}
        )
    )
