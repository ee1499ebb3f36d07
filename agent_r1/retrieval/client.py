"""One ``Retriever`` interface for tools: an index in this process, or a retriever server.

``HttpRetriever`` speaks the Search-R1 ``/retrieve`` API (``{"queries", "topk", "return_scores"}``
-> ``{"result": [[{"document", "score"}]]}``), so it also works against a Search-R1 / FlashRAG
retrieval server. A failing server is retried with back-off, then ``RetrievalError`` (the search
tool turns that into error feedback for the model; the episode goes on).

A run's retriever (``run_retriever``: its retriever role, or the index in-process) reaches the
search tools through the ``Services`` their environment is given, so recipes' tools need no
addresses.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from agent_r1.errors import AgentR1Error
from agent_r1.retrieval.index import Hit, Index

log = logging.getLogger("agent_r1.retrieval")


class RetrievalError(AgentR1Error, RuntimeError):
    pass


class Retriever(Protocol):
    async def search(self, queries: list[str], k: int) -> list[list[Hit]]: ...


class LocalRetriever:
    """An in-process index (tests, eval, single-machine runs); searches run off the event loop."""

    def __init__(self, index: Index):
        self.index = index

    async def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        return await asyncio.to_thread(self.index.search, queries, k)


class HttpRetriever:
    """``url``: the server's address, or a function giving its current one (a run's retriever
    role: read again for every attempt, so a restarted retriever on a new port is found)."""

    def __init__(
        self,
        url: str | Callable[[], str],
        api_key: str | None = None,
        timeout_s: float = 30.0,
        retries: int = 3,
    ):
        self._url = url if callable(url) else (lambda u=url: u)
        self.api_key, self.timeout_s, self.retries = api_key, timeout_s, retries

    @property
    def url(self) -> str:
        return self._url().rstrip("/")

    async def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        import aiohttp

        body = {"queries": queries, "topk": k, "return_scores": True}
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        last = ""
        for attempt in range(self.retries + 1):
            url = self.url
            try:
                timeout = aiohttp.ClientTimeout(total=self.timeout_s)
                async with aiohttp.ClientSession(timeout=timeout) as s:
                    async with s.post(f"{url}/retrieve", json=body, headers=headers) as r:
                        if r.status == 200:
                            data = await r.json()
                            return [[Hit.from_json(h) for h in hits] for hits in data["result"]]
                        last = f"HTTP {r.status}: {(await r.text())[:200]}"
                        if r.status < 500:  # the request itself is wrong: retrying will not help
                            break
            except (aiohttp.ClientError, TimeoutError, OSError) as e:
                last = f"{type(e).__name__}: {e}"
            if attempt < self.retries:
                await asyncio.sleep(min(0.5 * 2**attempt, 4.0))
        raise RetrievalError(f"retriever {url} failed: {last}")


@functools.lru_cache(maxsize=8)
def open_index(path: str, mode: str = "sparse") -> Index:
    """An index folder, loaded once per process."""
    return Index(Path(path), mode)


def run_retriever(cfg: Any, rd: Any = None) -> Retriever | None:
    """The run's retriever for this process's search tools: its retriever role (``retrieval.serve``
    and a run directory ``rd``) or the index in-process; None when the run has no ``retrieval.index``."""
    r = cfg.retrieval
    if not r.index:
        return None
    if r.serve and rd is not None:
        from agent_r1.http_service import follow_published

        current = follow_published(rd.retriever_file, cfg.rollout.ready_timeout_s, "retriever")
        log.info("search tools use the run's retriever at %s", current())
        return HttpRetriever(current, rd.api_key())  # a restarted retriever is found again
    log.info("search tools use the index %s in this process", r.index)
    return LocalRetriever(open_index(r.index, r.mode))


def make_retriever(index: str | None = None, url: str | None = None, mode: str = "sparse",
                   api_key: str | None = None, given: Retriever | None = None) -> Retriever:  # fmt: skip
    """The search tool's retriever: its own ``url`` or ``index`` option, else the one its
    environment was ``given`` (the run's, or a command's ``--index``)."""
    if url:
        return HttpRetriever(url, api_key)
    if index:
        return LocalRetriever(open_index(str(index), mode))
    if given is None:
        raise RetrievalError(
            "no retriever configured: set retrieval.index=DIR in the run's config (or --index DIR,"
            " or give the search tool an index or url option); build one with agent-r1 index build"
        )
    return given
