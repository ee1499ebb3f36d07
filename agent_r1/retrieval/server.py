"""``agent-r1 retriever serve --index DIR``: one index for every rollout worker of a run.

Routes: ``POST /retrieve`` (Search-R1's API: ``{"queries": [...], "topk": k, "return_scores":
true}`` -> ``{"result": [[{"document": {"id", "contents"}, "score"}]]}``; without scores the items
are the documents) and ``GET /health``. Queries from concurrent requests are searched together in
one batch. Bad requests get 400 with a message; an optional ``--api-key`` protects ``/retrieve``.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from aiohttp import web

from agent_r1.http_service import (
    BadRequest,
    api_key_middleware,
    client_limit,
    error_response,
    json_response,
    need,
    read_json_body,
    serve_until_stopped,
    service_errors,
    start_site,
)
from agent_r1.retrieval.index import Index

log = logging.getLogger("agent_r1.retriever")

MAX_QUERIES = 1024
MAX_QUERY_CHARS = 2000
MAX_TOPK = 100


def parse_request(body: Any) -> tuple[list[str], int, bool]:
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object with 'queries'")
    queries, k = body.get("queries"), body.get("topk", 3)
    if not isinstance(queries, list) or not queries:
        raise BadRequest("'queries' must be a non-empty list of strings")
    if len(queries) > MAX_QUERIES:
        raise BadRequest(f"at most {MAX_QUERIES} queries per request, got {len(queries)}")
    for i, q in enumerate(queries):
        if not isinstance(q, str):
            raise BadRequest(f"queries[{i}] must be a string, got {type(q).__name__}")
        if len(q) > MAX_QUERY_CHARS:
            raise BadRequest(f"queries[{i}] has {len(q)} characters (max {MAX_QUERY_CHARS})")
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_TOPK:
        raise BadRequest(f"'topk' must be an integer in 1..{MAX_TOPK}, got {k!r}")
    return queries, k, need(body, "return_scores", "bool", False)


class RetrieverServer:
    def __init__(self, index: Index, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None):
        self.index, self.host, self.port = index, host, port
        guard = [api_key_middleware(api_key)] if api_key else []
        self.app = web.Application(middlewares=[client_limit(), *guard, service_errors(error_response)])
        self.app.router.add_get("/health", self.health)
        self.app.router.add_post("/retrieve", self.retrieve)
        self._pending: list[tuple[list[str], int, asyncio.Future]] = []
        self._wake: asyncio.Event | None = None
        self.searches = 0

    async def health(self, request: web.Request) -> web.Response:
        return json_response({"status": "ok", "passages": len(self.index)})

    async def retrieve(self, request: web.Request) -> web.Response:
        try:
            queries, k, scores = parse_request(await read_json_body(request))
        except BadRequest as e:
            return error_response(str(e))
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((queries, k, fut))
        self._wake.set()
        hits = await fut
        if scores:
            return json_response({"result": [[h.to_json() for h in row] for row in hits]})
        return json_response({"result": [[h.to_json()["document"] for h in row] for row in hits]})

    async def _batcher(self) -> None:
        """All queries waiting at once go to the index as one batch (per distinct k)."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self._pending = self._pending, []
            by_k: dict[int, list[tuple[list[str], asyncio.Future]]] = {}
            for queries, k, fut in batch:
                by_k.setdefault(k, []).append((queries, fut))
            for k, items in by_k.items():
                flat = [q for qs, _ in items for q in qs]
                try:
                    hits = await asyncio.to_thread(self.index.search, flat, k)
                except Exception as e:  # noqa: BLE001 - reported to each waiting request
                    for _, fut in items:
                        if not fut.done():
                            fut.set_exception(e)
                    continue
                self.searches += 1
                i = 0
                for qs, fut in items:
                    if not fut.done():
                        fut.set_result(hits[i : i + len(qs)])
                    i += len(qs)

    async def start(self) -> web.AppRunner:
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._batcher())
        runner, self.port = await start_site(self.app, self.host, self.port)
        return runner

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def serve_retriever(
    index_dir: str,
    host: str = "127.0.0.1",
    port: int = 0,
    ready_file: str | Path | None = None,
    api_key: str | None = None,
    mode: str = "sparse",
    stop_when: Any = None,
) -> int:
    """Serve until SIGTERM / Ctrl-C / ``stop_when()``; ``ready_file`` gets ``{"url"}`` once serving."""
    index = Index(index_dir, mode)

    async def start() -> tuple[Any, str, dict[str, Any]]:
        server = RetrieverServer(index, host, port, api_key)
        runner = await server.start()
        log.info("retriever for %s (%d passages, %s) at %s", index_dir, len(index), mode, server.url)
        return runner, server.url, {"index": str(index_dir)}

    return serve_until_stopped(start, ready_file, stop_when)
