"""openai_agent: the arithmetic tool task, solved by an agent program written with the official
``openai`` SDK (``agent.py``) and trained through the agent gateway. The rows, the warm start's
demonstrations and the tokenizer corpus are ``arithmetic_tool``'s, so its results compare with the
built-in tool agent's on the same problems; only the agent differs."""

from __future__ import annotations

from agent_r1.data.rows import DataRow
from recipes.arithmetic_tool import data as arithmetic

AGENT = "openai_agent"
TOOLS = arithmetic.TOOLS  # the agent's own calculator shows the model the same schema
corpus = arithmetic.corpus
demonstrations = arithmetic.demonstrations


def build_rows(split: str = "train", num: int = 64, seed: int = 0, difficulty: int = 2) -> list[DataRow]:
    rows = arithmetic.build_rows(split, num, seed, difficulty)
    for r in rows:
        r.agent_name = AGENT
        r.data_source = AGENT
    return rows
