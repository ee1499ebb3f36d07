"""``search(query)``: top-k passages from the run's retriever (or a given index / server).

The result text is Search-R1's: ``Doc 1(Title: "T") text\\n`` per passage. ``info["hits"]`` carries the
passages as data (``id``, ``title``, ``text``) for environments that keep them as state. Empty,
whitespace-only or over-long queries are the model's error (``ToolError``); a retriever that stays
down after its retries is reported the same way, so the episode goes on and the error is counted.
"""

from __future__ import annotations

from typing import Any

from agent_r1.agent_tools.base import TOOLS, BaseTool, ToolError, ToolOutput, string_arguments
from agent_r1.retrieval.client import RetrievalError, make_retriever

MAX_QUERY_CHARS = 300


def format_hits(hits: list[Any]) -> str:
    """Search-R1's ``_passages2string``: per hit, the first line of its ``contents`` (the corpus's
    quoted title) as the title, the rest as the text, one newline after each document."""
    if not hits:
        return "No results."  # Search-R1 returns "": an empty tool response reads as a failure
    out = []
    for i, h in enumerate(hits, 1):
        title, _, text = (f'"{h.title}"\n{h.text}' if h.title else h.text).partition("\n")
        out.append(f"Doc {i}(Title: {title}) {text}\n")
    return "".join(out)


@TOOLS.register("search")
class Search(BaseTool):
    name = "search"
    description = "Search the encyclopedia. Returns the most relevant passages for the query."
    parameters = string_arguments(query="what to look up")
    timeout_s = 60.0

    def __init__(self, topk: int = 3, index: str | None = None, url: str | None = None, mode: str = "sparse"):
        if topk < 1:
            raise ValueError(f"search.topk must be >= 1, got {topk}")
        self.topk, self._spec = topk, (index, url, mode)

    async def execute(self, args: dict[str, Any]) -> ToolOutput:
        query = " ".join(args["query"].split())
        if not query:
            raise ToolError("the query is empty")
        if len(query) > MAX_QUERY_CHARS:
            raise ToolError(f"the query has {len(query)} characters (max {MAX_QUERY_CHARS})")
        index, url, mode = self._spec
        try:
            hits = (
                await make_retriever(index, url, mode, given=self.services.retriever).search(
                    [query], self.topk
                )
            )[0]
        except RetrievalError as e:
            raise ToolError(f"retrieval failed ({e})") from None
        return self.output(query, hits)

    def output(self, query: str, hits: list[Any]) -> ToolOutput:
        info = {"query": query, "hits": [{"id": h.id, "title": h.title, "text": h.text} for h in hits]}
        return ToolOutput(format_hits(hits), None, info)
