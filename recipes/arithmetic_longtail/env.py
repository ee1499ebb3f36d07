"""arithmetic_longtail: arithmetic_tool's problems behind a slow calculator (a job that must be
polled): the number of polls and the latency of each call are the row's, drawn heavy-tailed."""

import asyncio
from typing import Any

from agent_r1.agent.flow import AGENTS, AgentEnvLoop, AgentSpec
from agent_r1.agent_tools import TOOLS, ToolOutput
from agent_r1.agent_tools.calculator import Calculator
from recipes.arithmetic_longtail.data import AGENT, MAX_STEPS, PENDING, SYSTEM


class JobCalculator(Calculator):
    """The calculator as a remote job: each call takes ``delay_s``; the first ``polls - 1`` calls
    answer ``PENDING`` (call again), the ``polls``-th the result. One instance per episode."""

    timeout_s = 120.0  # the row's latency is the point: only a stuck job times out

    def __init__(self, polls: int = 1, delay_s: float = 0.0, **kwargs: Any):
        super().__init__(**kwargs)
        if polls < 1 or delay_s < 0:
            raise ValueError(f"job_calculator: polls >= 1 and delay_s >= 0, got {polls}, {delay_s}")
        self.polls, self.delay_s, self.calls = polls, delay_s, 0

    async def execute(self, args: dict[str, Any]) -> ToolOutput:
        await asyncio.sleep(self.delay_s)
        self.calls += 1
        if self.calls < self.polls:
            return ToolOutput(PENDING)
        return await super().execute(args)


if "job_calculator" not in TOOLS:
    TOOLS.register("job_calculator")(JobCalculator)

if AGENT not in AGENTS:
    AGENTS.register(AGENT)(
        AgentSpec(
            AgentEnvLoop,
            {"env": "tool", "tools": ["job_calculator"], "max_steps": MAX_STEPS, "system_prompt": SYSTEM},
        )
    )
