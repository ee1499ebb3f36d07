"""The same arithmetic agent written with the OpenAI Agents SDK (``openai-agents``, a widely used
agent library): an ``Agent`` with one function tool, run by its ``Runner`` over Chat Completions
at ``OPENAI_BASE_URL``. The library owns the loop and the history; the gateway records its calls.

The tool shows the model the calculator's own schema (``agent.CALCULATOR``, not one generated from
a Python signature), so the prompt is the one the built-in agent's warm start taught.
"""

from __future__ import annotations

from agents import Agent, FunctionTool, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
from openai import AsyncOpenAI

from recipes.openai_agent.agent import CALCULATOR, MAX_TURNS, run_tool


async def solve(task: dict) -> str:
    set_tracing_disabled(True)  # nothing leaves the machine
    system, question = task["prompt"][0]["content"], task["prompt"][-1]["content"]
    fn = CALCULATOR["function"]

    async def calculator(ctx, arguments: str) -> str:
        return run_tool(fn["name"], arguments)

    tool = FunctionTool(
        name=fn["name"],
        description=fn["description"],
        params_json_schema=fn["parameters"],
        on_invoke_tool=calculator,
        strict_json_schema=False,
    )
    model = OpenAIChatCompletionsModel(model="policy", openai_client=AsyncOpenAI(max_retries=0))
    agent = Agent(name="arithmetic", instructions=system, tools=[tool], model=model)
    result = await Runner.run(agent, question, max_turns=MAX_TURNS)
    return str(result.final_output or "")
