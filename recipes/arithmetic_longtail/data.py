"""arithmetic_tool's problems as a long-tail agentic workload (``tools/bench/stream.py``): the
calculator is a remote job that answers "pending" until it has been polled the row's number of
times, each call taking the row's latency. Both are drawn per row from heavy-tailed (Pareto)
distributions with a fixed seed, so most episodes take two steps and under a second of tool
time (a search, a code run), and a few take the step limit and tens of seconds: the tail a
synchronous iteration waits for. The reward, the demonstrations (a noisy demonstrator that polls until the result) and
the held-out split are arithmetic_tool's.
"""

from __future__ import annotations

import dataclasses
import random

from agent_r1.agent.demonstrations import noisy_demonstrations
from agent_r1.agent.tool_calls import format_tool_call
from agent_r1.data.rows import DataRow
from recipes.arithmetic_tool import data as arithmetic_tool
from recipes.arithmetic_tool.data import demonstration, make_problem

AGENT = "arithmetic_longtail"
SYSTEM = arithmetic_tool.SYSTEM  # the same instructions: the calculator, then \boxed{N}
TOOLS = ["job_calculator"]  # shown to the model as "calculator"
PENDING = "pending: the job is still running, call the calculator again"
MAX_STEPS = 8  # the polls and the answer


def heavy_tail(rng: random.Random, alpha: float, scale: float, cap: float) -> float:
    """A Pareto(``alpha``) draw of minimum ``scale``, capped at ``cap``."""
    return min(cap, scale * rng.paretovariate(alpha))


def build_rows(
    split: str = "train",
    num: int = 64,
    seed: int = 0,
    difficulty: int = 1,
    polls_alpha: float = 1.3,
    max_polls: int = MAX_STEPS - 1,
    delay_s: float = 0.3,
    delay_alpha: float = 1.2,
    max_delay_s: float = 3.0,
) -> list[DataRow]:
    """Rows for ``split`` (disjoint seed streams per split, as arithmetic_tool's); each row's job
    needs ``polls`` calls (Pareto(``polls_alpha``) rounded down, 1..``max_polls``) of ``delay`` s
    each (Pareto(``delay_alpha``) from ``delay_s``, at most ``max_delay_s``)."""
    tail = random.Random(seed * 104_729 + {"train": 0, "test": 1_000_003, "val": 2_000_003}[split] + 17)
    rows = []
    for row in arithmetic_tool.build_rows(split, num, seed, difficulty):  # the same problems
        polls = int(heavy_tail(tail, polls_alpha, 1.0, max_polls))
        delay = round(heavy_tail(tail, delay_alpha, delay_s, max_delay_s), 4)
        rows.append(
            dataclasses.replace(
                row,
                agent_name=AGENT,
                data_source="arithmetic_longtail",
                env_kwargs={"tool_kwargs": {"job_calculator": {"polls": polls, "delay_s": delay}}},
                extra_info={**row.extra_info, "polls": polls, "delay_s": delay},
            )
        )
    return rows


def demonstrations(rows: list[DataRow], seed: int = 0, tool_rate: float = 1.0) -> list[list[str]]:
    """The noisy demonstrator of arithmetic_tool, polling the job until it answers: ``polls``
    calculator calls, then the boxed answer; or (1 - ``tool_rate``) a guess without the tool."""

    def with_tool(row: DataRow) -> list[str]:
        call = format_tool_call("calculator", {"expression": row.extra_info["expression"]})
        answer = row.reward_model["ground_truth"]
        return [call] * row.extra_info["polls"] + [f"The answer is \\boxed{{{answer}}}."]

    def without_tool(row: DataRow) -> list[str]:
        return [f"The answer is \\boxed{{{row.extra_info['expression'].split(' ')[0].strip('()')}}}."]

    return noisy_demonstrations(rows, seed, tool_rate, with_tool, without_tool)


def corpus(num: int = 2000, seed: int = 0) -> list[str]:
    """Texts a tokenizer for this task is trained on: arithmetic_tool's, and the pending answer."""
    rng = random.Random(seed)
    texts = [PENDING] * 50
    for i in range(num):
        texts += [m["content"] for m in demonstration(make_problem(rng, 1 + i % 6))]
    return texts
