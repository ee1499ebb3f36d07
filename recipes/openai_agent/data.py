"""openai_agent: the arithmetic tool task, solved by an agent program written with the official
``openai`` SDK (``agent.py``) and trained through the agent gateway. The rows, the warm start's
demonstrations and the tokenizer corpus are ``arithmetic_tool``'s, so its results compare with the
built-in tool agent's on the same problems; only the agent differs."""

from __future__ import annotations

from agent_r1.data.rows import DataRow
from recipes.arithmetic_tool import data as arithmetic

AGENT = "openai_agent"
AGENTS_SDK = "openai_agents_sdk"  # the same agent written with the OpenAI Agents SDK
PLAIN_HTTP = "openai_plain_http"  # ... and with no SDK: the wire protocol over urllib
TOOLS = arithmetic.TOOLS  # the agent's own calculator shows the model the same schema
corpus = arithmetic.corpus
demonstrations = arithmetic.demonstrations


def build_rows(
    split: str = "train", num: int = 64, seed: int = 0, difficulty: int = 2, library: str = "openai"
) -> list[DataRow]:
    """``library``: ``openai`` (``agent.py``: the SDK alone), ``agents_sdk`` (``agents_sdk.py``:
    the OpenAI Agents SDK) or ``http`` (``plain_http.py``: no SDK)."""
    agents = {"openai": AGENT, "agents_sdk": AGENTS_SDK, "http": PLAIN_HTTP}
    if library not in agents:
        raise ValueError(f"recipe openai_agent: library must be one of {sorted(agents)}, got {library!r}")
    rows = arithmetic.build_rows(split, num, seed, difficulty)
    for r in rows:
        r.agent_name = agents[library]
        r.data_source = AGENT
    return rows
