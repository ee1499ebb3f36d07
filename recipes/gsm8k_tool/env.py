"""gsm8k_tool: ToolEnv + calculator, up to 5 steps; malformed calls cost 0.1 process reward."""

from agent_r1.agent.flow import AGENTS, AgentEnvLoop, AgentSpec
from recipes.gsm8k_tool.data import AGENT

if AGENT not in AGENTS:
    AGENTS.register(AGENT)(
        AgentSpec(
            AgentEnvLoop, {"env": "tool", "tools": ["calculator"], "max_steps": 5, "error_penalty": 0.1}
        )
    )
