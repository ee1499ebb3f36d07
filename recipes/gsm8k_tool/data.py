"""GSM8K with the calculator tool: the same problems, a ToolEnv episode per problem."""

from __future__ import annotations

from agent_r1.data.rows import DataRow
from recipes.gsm8k.data import SAMPLE, problems_for, read_gsm8k, to_row

AGENT = "gsm8k_tool"
SYSTEM = "You are a math assistant. Use the calculator tool for arithmetic."

TOOLS = ["calculator"]  # the tools its prompt shows


def build_rows(
    split: str = "train", num: int | None = None, seed: int = 0, path: str | None = None
) -> list[DataRow]:
    return [to_row(p, AGENT, SYSTEM, split) for p in problems_for(split, num, path)]


def corpus(num: int = 0, seed: int = 0) -> list[str]:
    return [p["question"] + "\n" + p["solution"] for p in read_gsm8k(SAMPLE)]
