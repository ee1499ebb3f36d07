"""arithmetic_tool: ToolEnv with the calculator; the answer is scored by ``math_number``."""

from agent_r1.agent.flow import AGENTS, AgentEnvLoop, AgentSpec
from recipes.arithmetic_tool.data import AGENT, SYSTEM

if AGENT not in AGENTS:
    AGENTS.register(AGENT)(
        AgentSpec(
            AgentEnvLoop, {"env": "tool", "tools": ["calculator"], "max_steps": 4, "system_prompt": SYSTEM}
        )
    )
