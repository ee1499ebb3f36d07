"""The paper-search tools: ``search(query)`` over the paper index (the run's retriever) and
``expand(paper_id)`` over the citation graph (references and citing papers). Both list papers as
``[id] title`` and return them in ``info["papers"]`` for the environment's state."""

from __future__ import annotations

from typing import Any

from agent_r1.agent_tools import TOOLS, BaseTool, ToolError, ToolOutput
from agent_r1.agent_tools.base import string_arguments
from agent_r1.agent_tools.search import Search
from recipes.paper_search.graph import load_graph


def _listing(papers: list[tuple[str, str]]) -> str:
    return "\n".join(f"[{pid}] {title}" for pid, title in papers) or "No papers."


@TOOLS.register("paper_search")
class PaperSearch(Search):
    """The search tool over the paper index, listing ``[id] title``."""

    description = "Search the paper index. Returns the ids and titles of the best matching papers."
    parameters = string_arguments(query="keywords")

    def output(self, query: str, hits: list[Any]) -> ToolOutput:
        papers = [(h.id, h.title) for h in hits]
        return ToolOutput(_listing(papers), None, {"query": query, "papers": [p[0] for p in papers]})


@TOOLS.register("expand")
class Expand(BaseTool):
    name = "expand"
    description = "List the papers a paper cites and the papers citing it."
    parameters = string_arguments(paper_id="a paper id such as P0012")

    def __init__(self, graph: str | None = None, seed: int = 0):
        self.graph = load_graph(graph, seed)

    async def execute(self, args: dict[str, Any]) -> ToolOutput:
        pid = args["paper_id"].strip().strip("[]")
        if pid not in self.graph.papers:
            raise ToolError(f"unknown paper id {pid!r}")
        near = self.graph.neighbours(pid)
        papers = [(q, self.graph.papers[q].title) for q in near]
        return ToolOutput(_listing(papers), None, {"paper_id": pid, "papers": near})
