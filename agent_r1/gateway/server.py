"""The gateway: one OpenAI-compatible endpoint per worker process, a path per session.

``/sessions/<id>/v1/chat/completions`` (streaming and tool calls as ``agent-r1 serve`` answers
them), ``/sessions/<id>/v1/models`` and ``POST /sessions/<id>/reward`` (``{"reward": x}``, optional
``"success"``). Every route needs ``Authorization: Bearer <key>`` with the session's key (the run's
API key; a fresh random one where the run has none). The gateway serves from its own thread and
event loop, so it outlives the event loops the worker runs its tasks in; each call's step runs in
its session's loop (where the run's rollout client lives).

What the episode's sampling decides is not the program's to change: ``temperature``, ``top_p``,
``seed`` and the like are ignored (training samples on policy); ``max_tokens`` may only shorten
the episode's action budget. ``n`` > 1 and ``stop`` strings are refused with a 400.
"""

from __future__ import annotations

import asyncio
import hmac
import threading
import time
import uuid
from typing import Any

from aiohttp import web

from agent_r1.gateway.session import Session, SessionOver
from agent_r1.http_service import BadRequest, dumps, read_json_body, start_site
from agent_r1.serving.openai_api import (
    InvalidRequest,
    error_response,
    field_of,
    message_chunks,
    token_logprob,
    tool_schemas,
)

MODEL = "policy"  # the model name the gateway answers with, whatever the program asked for


class Gateway:
    _instance: Gateway | None = None
    _guard = threading.Lock()

    @classmethod
    def get(cls) -> Gateway:
        """This process's gateway (started on first use; a daemon thread serves it)."""
        with cls._guard:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def __init__(self, host: str = "127.0.0.1"):
        self.sessions: dict[str, Session] = {}
        self.loop = asyncio.new_event_loop()
        started: dict[str, Any] = {}
        ready = threading.Event()

        def serve() -> None:
            asyncio.set_event_loop(self.loop)
            try:
                started["port"] = self.loop.run_until_complete(self._start(host))[1]
            except BaseException as e:  # noqa: BLE001 - reported to the starting thread
                started["error"] = e
            ready.set()
            if "error" not in started:
                self.loop.run_forever()

        threading.Thread(target=serve, name="agent-r1-gateway", daemon=True).start()
        ready.wait()
        if "error" in started:
            raise RuntimeError(f"the agent gateway could not start: {started['error']}")
        self.url = f"http://{host}:{started['port']}"

    async def _start(self, host: str) -> tuple[web.AppRunner, int]:
        app = web.Application(client_max_size=64 << 20)
        r = app.router
        r.add_get("/sessions/{sid}/v1/models", self._models)
        r.add_post("/sessions/{sid}/v1/chat/completions", self._chat)
        r.add_post("/sessions/{sid}/reward", self._reward)
        return await start_site(app, host, 0)

    # ---- sessions --------------------------------------------------------------------------------
    def open(self, session: Session) -> str:
        """Serve ``session``; returns its base URL (what ``OPENAI_BASE_URL`` is set to)."""
        self.sessions[session.id] = session
        return f"{self.url}/sessions/{session.id}/v1"

    def reward_url(self, session: Session) -> str:
        return f"{self.url}/sessions/{session.id}/reward"

    def close(self, session: Session) -> None:
        self.sessions.pop(session.id, None)

    def _session(self, request: web.Request) -> Session | web.Response:
        s = self.sessions.get(request.match_info["sid"])
        if s is None:
            return error_response("no such session (the episode has ended, or the URL is wrong)", status=404)
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {s.api_key}".encode()):
            return error_response("unauthorized: the session needs its API key (OPENAI_API_KEY)", status=401)
        return s

    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = await read_json_body(request)
        except BadRequest as e:
            raise InvalidRequest(str(e)) from None
        if not isinstance(body, dict):
            raise InvalidRequest(f"request body must be a JSON object, got {type(body).__name__}")
        return body

    async def _in_session(self, s: Session, coro: Any) -> Any:
        """Run ``coro`` in the session's event loop (its step generates through the run's client)."""
        fut = asyncio.run_coroutine_threadsafe(coro, s.loop)
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            fut.cancel()  # the program hung up: the step stops too
            raise

    # ---- routes ------------------------------------------------------------------------------------
    async def _models(self, request: web.Request) -> web.Response:
        s = self._session(request)
        if isinstance(s, web.Response):
            return s
        model = {"id": MODEL, "object": "model", "created": 0, "owned_by": "agent-r1"}
        return web.json_response({"object": "list", "data": [model]}, dumps=dumps)

    async def _reward(self, request: web.Request) -> web.Response:
        s = self._session(request)
        if isinstance(s, web.Response):
            return s
        try:
            body = await self._body(request)
            reward = field_of(body, "reward", (int, float), None)
            if reward is None or reward != reward or abs(reward) == float("inf"):
                raise InvalidRequest("reward: required, a finite number", "reward")
            success = field_of(body, "success", (bool,), reward > 0)
        except InvalidRequest as e:
            return error_response(str(e), e.param)
        s.reward = {"reward": float(reward), "success": success}
        return web.json_response({"ok": True}, dumps=dumps)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        s = self._session(request)
        if isinstance(s, web.Response):
            return s
        try:
            body = await self._body(request)
            if field_of(body, "n", (int,), 1) != 1:
                raise InvalidRequest("n: one completion per call (each call is one step of the episode)", "n")
            if body.get("stop") is not None:
                raise InvalidRequest(
                    "stop: stop strings are not supported by the gateway (a reply ends at the model's "
                    "end of turn)",
                    "stop",
                )
            max_tokens = field_of(body, "max_completion_tokens", (int,), None) or field_of(
                body, "max_tokens", (int,), None
            )
            if max_tokens is not None and max_tokens < 1:
                raise InvalidRequest("max_tokens: must be >= 1", "max_tokens")
            want_lp = bool(field_of(body, "logprobs", (bool,), False))
            tools = tool_schemas(body)
            msg, finish, ids, lps, prompt_len = await self._in_session(
                s, s.complete(body.get("messages"), tools, max_tokens)
            )
        except InvalidRequest as e:
            return error_response(str(e), e.param)
        except SessionOver as e:
            return error_response(str(e), status=400)
        except Exception as e:  # noqa: BLE001 - the policy servers failed: the flow re-raises it
            return error_response(f"the policy servers failed: {e}", status=503)
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": MODEL}
        if body.get("stream"):
            resp = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            await resp.prepare(request)
            for c in message_chunks(head, msg, finish):
                await resp.write(f"data: {dumps(c)}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        tok = s.codec.tokenizer
        logprobs = (
            {
                "content": [
                    {**token_logprob(tok, t, lp), "top_logprobs": []} for t, lp in zip(ids, lps, strict=True)
                ]
            }
            if want_lp
            else None
        )
        out = {
            **head,
            "object": "chat.completion",
            "choices": [{"index": 0, "message": msg, "finish_reason": finish, "logprobs": logprobs}],
            "usage": {
                "prompt_tokens": prompt_len,
                "completion_tokens": len(ids),
                "total_tokens": prompt_len + len(ids),
            },
        }
        return web.json_response(out, dumps=dumps)
