"""``agent-r1 env serve webshop``: the WebShop site as an HTTP service, many shoppers at once.

Routes (JSON): ``POST /reset {"goal"}`` -> ``{"session"}``; ``POST /step {"session", "action"}`` ->
``{"valid", "message", "snapshot"}``; ``POST /close {"session"}``; ``GET /health``. Each session is
its own state (page, results, item, options); the products and the search index are shared. Idle
sessions beyond ``max_sessions`` are dropped oldest first. Bad requests get 400 naming the field,
an unknown session 404. The run's API key protects every route but ``/health``.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections import OrderedDict
from pathlib import Path
from typing import Any

from aiohttp import web

from agent_r1.http_service import (
    BadRequest,
    api_key_middleware,
    client_limit,
    describe,
    error_response,
    json_response,
    need,
    read_json_body,
    serve_until_stopped,
    service_errors,
    start_site,
)
from recipes.webshop.catalog import Goal
from recipes.webshop.data import PRODUCTS_PER_KIND
from recipes.webshop.sessions import snapshot
from recipes.webshop.shop import Session, Shop

log = logging.getLogger("agent_r1.webshop_server")
GOAL_KEYS = {f.name for f in dataclasses.fields(Goal)}


GOAL_FIELDS = {"asin": "text", "category": "str", "query": "str", "name": "str", "product_category": "str",
               "instruction_text": "str", "attributes": "str_list", "price_upper": "number", "weight": "number"}  # fmt: skip


def goal_from_json(goal: Any) -> Goal:
    """A ``/reset`` goal: every field of ``Goal`` with the type the shop and the reward read it as."""
    if not isinstance(goal, dict) or set(goal) != GOAL_KEYS:
        raise BadRequest(f"goal: must be an object with keys {sorted(GOAL_KEYS)}")
    for key, kind in GOAL_FIELDS.items():
        need(goal, key, kind, where="goal.")
    opts = goal["goal_options"]
    if not (
        (isinstance(opts, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in opts.items()))
        or (isinstance(opts, list) and all(isinstance(v, str) for v in opts))
    ):
        raise BadRequest(
            f"goal.goal_options: must be an object of strings or a list of strings, got {describe(opts)}"
        )
    return Goal(**goal)


class WebShopServer:
    def __init__(self, shop: Shop, api_key: str | None = None, max_sessions: int = 10000):
        self.shop, self.max_sessions = shop, max_sessions
        self.sessions: OrderedDict[str, Session] = OrderedDict()
        guard = [api_key_middleware(api_key)] if api_key else []
        self.app = web.Application(middlewares=[client_limit(), *guard, service_errors(error_response)])
        self.app.router.add_get("/health", self.health)
        self.app.router.add_post("/reset", self.reset)
        self.app.router.add_post("/step", self.step)
        self.app.router.add_post("/close", self.close)

    async def _body(self, request: web.Request) -> dict[str, Any]:
        body = await read_json_body(request)
        if not isinstance(body, dict):
            raise BadRequest("body must be a JSON object")
        return body

    async def health(self, request: web.Request) -> web.Response:
        return json_response(
            {"status": "ok", "sessions": len(self.sessions), "products": len(self.shop.products)}
        )

    async def reset(self, request: web.Request) -> web.Response:
        try:
            goal = goal_from_json((await self._body(request)).get("goal"))
        except BadRequest as e:
            return error_response(str(e))
        sid = uuid.uuid4().hex
        self.sessions[sid] = Session(goal)
        while len(self.sessions) > self.max_sessions:
            self.sessions.popitem(last=False)
        return json_response({"session": sid})

    def _session(self, body: dict[str, Any]) -> Session | None:
        sid = body.get("session")
        if not isinstance(sid, str):
            raise BadRequest("'session' must be a string")
        s = self.sessions.get(sid)
        if s is not None:
            self.sessions.move_to_end(sid)
        return s

    async def step(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request)
            s = self._session(body)
            if not isinstance(body.get("action"), str):
                raise BadRequest("'action' must be a string")
        except BadRequest as e:
            return error_response(str(e))
        if s is None:
            return error_response(
                f"no session {body['session']!r} (closed, expired, or the server restarted)", 404
            )
        ok, why = self.shop.step(s, body["action"])
        return json_response(
            {"valid": ok, "message": why, "snapshot": dataclasses.asdict(snapshot(self.shop, s))}
        )

    async def close(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request)
            self._session(body)
        except BadRequest as e:
            return error_response(str(e))
        self.sessions.pop(body["session"], None)
        return json_response({"closed": True})


def serve(host: str = "127.0.0.1", port: int = 0, ready_file: str | Path | None = None,
          api_key: str | None = None, stop_when: Any = None, data: str | None = None, seed: int = 0,
          human: bool = False, products: int = PRODUCTS_PER_KIND, **_: Any) -> int:  # fmt: skip
    """Serve until SIGTERM / Ctrl-C / ``stop_when()``; ``ready_file`` gets ``{"url"}`` once serving.
    ``data`` / ``seed`` / ``human`` / ``products``: the catalogue (the recipe's options; others are
    ignored)."""
    from recipes.webshop.data import shop_for

    shop = shop_for(data, seed, human, products)

    async def start() -> tuple[Any, str, dict[str, Any]]:
        server = WebShopServer(shop, api_key)
        runner, bound = await start_site(server.app, host, port)
        url = f"http://{host}:{bound}"
        log.info("webshop environment (%d products) at %s", len(shop.products), url)
        return runner, url, {}

    return serve_until_stopped(start, ready_file, stop_when)
