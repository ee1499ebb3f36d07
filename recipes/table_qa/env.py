"""table_qa: ToolEnv with the sandboxed python tool; the row's table is put in each run's folder."""

from agent_r1.agent.flow import AGENTS, AgentEnvLoop, AgentSpec
from recipes.table_qa.data import AGENT, SYSTEM

if AGENT not in AGENTS:
    AGENTS.register(AGENT)(
        AgentSpec(AgentEnvLoop, {"env": "tool", "tools": ["python"], "max_steps": 4, "system_prompt": SYSTEM})
    )
