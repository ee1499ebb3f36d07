"""The paper-search tools: ``search(query)`` over the paper index (the run's retriever) and
``expand(paper_id)`` over the citation graph (references and citing papers). Both list papers as
``[id] title`` and return them in ``info["papers"]`` for the environment's state."""

from __future__ import annotations

from typing import Any

from agent_r1.retrieval.client import RetrievalError, make_retriever
from agent_r1.tools import TOOLS, BaseTool, ToolError, ToolOutput
from recipes.paper_search.graph import load_graph

MAX_QUERY_CHARS = 300


def _listing(papers: list[tuple[str, str]]) -> str:
    return "\n".join(f"[{pid}] {title}" for pid, title in papers) or "No papers."


@TOOLS.register("paper_search")
class PaperSearch(BaseTool):
    name = "search"
    description = "Search the paper index. Returns the ids and titles of the best matching papers."
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {"query": {"type": "string", "description": "keywords"}},
        "required": ["query"],
    }
    timeout_s = 60.0

    def __init__(self, topk: int = 3, index: str | None = None, url: str | None = None):
        if topk < 1:
            raise ValueError(f"search.topk must be >= 1, got {topk}")
        self.topk, self.index, self.url = topk, index, url

    async def execute(self, args: dict[str, Any]) -> ToolOutput:
        query = " ".join(args["query"].split())
        if not query:
            raise ToolError("the query is empty")
        if len(query) > MAX_QUERY_CHARS:
            raise ToolError(f"the query has {len(query)} characters (max {MAX_QUERY_CHARS})")
        try:
            hits = (await make_retriever(self.index, self.url).search([query], self.topk))[0]
        except RetrievalError as e:
            raise ToolError(f"retrieval failed ({e})") from None
        papers = [(h.id, h.title) for h in hits]
        return ToolOutput(_listing(papers), None, {"query": query, "papers": [p[0] for p in papers]})


@TOOLS.register("expand")
class Expand(BaseTool):
    name = "expand"
    description = "List the papers a paper cites and the papers citing it."
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {"paper_id": {"type": "string", "description": "a paper id such as P0012"}},
        "required": ["paper_id"],
    }

    def __init__(self, graph: str | None = None, seed: int = 0):
        self.graph = load_graph(graph, seed)

    async def execute(self, args: dict[str, Any]) -> ToolOutput:
        pid = args["paper_id"].strip().strip("[]")
        if pid not in self.graph.papers:
            raise ToolError(f"unknown paper id {pid!r}")
        near = self.graph.neighbours(pid)
        papers = [(q, self.graph.papers[q].title) for q in near]
        return ToolOutput(_listing(papers), None, {"paper_id": pid, "papers": near})
