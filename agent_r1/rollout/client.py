"""RolloutClient: the agent layer's ``generate`` over SGLang-compatible servers.

Many servers (least-loaded choice, sticky per trajectory so a multi-step episode reuses its
server's prefix cache) or one ``sglang-router`` in front. Failed requests (connection errors,
5xx, timeouts) are retried on another server; 400s are the caller's fault and raise at once.
The same code drives real SGLang servers and the embedded engine: ``/generate`` has no branch on
server type.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import OrderedDict
from typing import Any

import aiohttp

from agent_r1.errors import AgentR1Error
from agent_r1.rollout.protocol import Completion, FinishReason, SamplingParams


class RolloutError(AgentR1Error, RuntimeError):
    """No server could serve a request; the message lists what each one said."""


class RequestRejected(AgentR1Error, ValueError):
    """The server answered 400: the request itself is invalid (message from the server)."""


async def probe(urls: list[str], path: str, timeout_s: float = 10.0, api_key: str | None = None) -> list[Any]:
    """GET ``path`` on every server at once, no retries: each answer, or the exception it raised."""
    if not urls:
        return []
    client = RolloutClient(servers=urls, timeout_s=timeout_s, max_retries=0, api_key=api_key)
    try:
        return await asyncio.gather(*(client.get(u, path) for u in urls), return_exceptions=True)
    finally:
        await client.close()


def weight_version(info: Any) -> int:
    """The integer weight version in a ``/get_model_info`` answer (SGLang reports it there as a
    string); -1 for anything else (an error, a non-numeric version)."""
    v = info.get("weight_version") if isinstance(info, dict) else None
    try:
        return int(v)
    except (TypeError, ValueError):
        return -1


async def server_versions(urls: list[str], api_key: str | None = None) -> dict[str, int]:
    """Weight version of every server that answers ``/get_model_info`` (dead ones are left out)."""
    answers = await probe(urls, "/get_model_info", api_key=api_key)
    return {u: weight_version(a) for u, a in zip(urls, answers, strict=True) if isinstance(a, dict)}


def to_completion(out: dict[str, Any]) -> Completion:
    meta = out["meta_info"]
    fr = (meta.get("finish_reason") or {}).get("type", "abort")
    reason = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}.get(
        fr, FinishReason.ERROR
    )
    triples = meta.get("output_token_logprobs")
    ids = out.get("output_ids") or ([t[1] for t in triples] if triples else [])
    logprobs = [float(t[0]) for t in triples] if triples else [0.0] * len(ids)
    version = str(meta.get("weight_version", "0"))
    return Completion(list(ids), logprobs, reason, int(version) if version.isdigit() else 0)


class RolloutClient:
    def __init__(
        self,
        servers: list[str] | None = None,
        router: str | None = None,
        timeout_s: float = 600.0,
        max_retries: int = 3,
        cooldown_s: float = 5.0,
        api_key: str | None = None,
    ):
        """``api_key``: sent as ``Authorization: Bearer KEY`` (servers started with ``--api-key``)."""
        if not servers and not router:
            raise ValueError("RolloutClient needs servers or a router URL")
        self.servers = [s.rstrip("/") for s in servers or []]
        self.router = router.rstrip("/") if router else None
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.max_retries, self.cooldown_s = max_retries, cooldown_s
        self.inflight: dict[str, int] = {s: 0 for s in self.servers}
        self.down_until: dict[str, float] = {}
        self.sticky: OrderedDict[str, str] = OrderedDict()
        self.rid_server: dict[str, str] = {}
        self.disabled: set[str] = set()  # e.g. servers that missed a weight update
        self._session: aiohttp.ClientSession | None = None
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    # ---- plumbing --------------------------------------------------------------------------------
    async def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self.timeout, headers=self.headers)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def _choose(self, session: str | None, exclude: set[str]) -> str:
        if self.router:
            return self.router
        now = time.monotonic()
        usable = [s for s in self.servers if s not in self.disabled]
        up = [s for s in usable if s not in exclude and self.down_until.get(s, 0) <= now]
        if not up:
            up = [s for s in usable if s not in exclude]
        if not up:
            raise RolloutError("no rollout server left to try")
        if session is not None and self.sticky.get(session) in up:
            self.sticky.move_to_end(session)
            return self.sticky[session]
        best = min(up, key=lambda s: self.inflight.get(s, 0))
        if session is not None:
            self.sticky[session] = best
            if len(self.sticky) > 10000:
                self.sticky.popitem(last=False)
        return best

    async def post(self, url: str, path: str, body: dict[str, Any] | None = None) -> Any:
        http = await self._http()
        async with http.post(url + path, json=body or {}) as resp:
            text = await resp.text()
            if resp.status >= 400:
                raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status, message=text)
            return json.loads(text) if text and resp.content_type == "application/json" else text

    async def get(self, url: str, path: str) -> Any:
        http = await self._http()
        async with http.get(url + path) as resp:
            text = await resp.text()
            if resp.status >= 400:
                raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status, message=text)
            return json.loads(text) if resp.content_type == "application/json" else text

    # ---- generate ---------------------------------------------------------------------------------
    async def generate_raw(self, payload: dict[str, Any], session: str | None = None) -> Any:
        """POST /generate with retries on other servers; returns SGLang's JSON."""
        rid = payload.setdefault("rid", uuid.uuid4().hex)
        tried: set[str] = set()
        errors: list[str] = []
        for _ in range(max(1, self.max_retries if self.router is None else 1 + self.max_retries)):
            if self.router is None and len(tried) >= len(set(self.servers) - self.disabled):
                break
            server = self._choose(session, tried if self.router is None else set())
            tried.add(server)
            self.inflight[server] = self.inflight.get(server, 0) + 1
            self.rid_server[rid] = server
            try:
                return await self.post(server, "/generate", payload)
            except aiohttp.ClientResponseError as e:
                if e.status == 400:
                    raise RequestRejected(f"{server} rejected the request: {e.message}") from None
                errors.append(f"{server}: HTTP {e.status} {e.message[:200]}")
            except (aiohttp.ClientConnectionError, TimeoutError) as e:
                errors.append(f"{server}: {type(e).__name__}: {e}")
            finally:
                self.inflight[server] -= 1
                self.rid_server.pop(rid, None)
            self.down_until[server] = time.monotonic() + self.cooldown_s
            if session is not None:
                self.sticky.pop(session, None)
        raise RolloutError("generate failed on every server tried: " + "; ".join(errors))

    async def __call__(
        self,
        token_ids: list[int],
        sampling: SamplingParams,
        session: str | None = None,
        images: list[Any] | None = None,
    ) -> Completion:
        payload = {
            "input_ids": list(token_ids),
            "sampling_params": sampling.to_sglang(),
            "return_logprob": True,
        }
        if images:  # SGLang's field: one base64 image per <|image_pad|> run, in order
            payload["image_data"] = [im.base64() for im in images]
        return to_completion(await self.generate_raw(payload, session))

    def session(self, session_id: str):
        """A ``GenerateFn`` bound to one trajectory: its steps stick to one server."""

        async def generate(
            token_ids: list[int], sampling: SamplingParams, images: list[Any] | None = None
        ) -> Completion:
            return await self(token_ids, sampling, session=session_id, images=images)

        return generate

    # ---- control ------------------------------------------------------------------------------------
    async def workers(self) -> list[str]:
        if self.router is None:
            return list(self.servers)
        data = await self.get(self.router, "/workers")
        return [w["url"].rstrip("/") for w in data.get("workers", [])]

    async def abort(self, rid: str | None = None) -> None:
        """Abort one request (on the server that has it) or, with ``rid=None``, everything."""
        targets = (
            [self.rid_server[rid]]
            if rid and rid in self.rid_server and not self.router
            else await self.workers()
        )
        body = {"rid": rid or "", "abort_all": rid is None}
        await asyncio.gather(*(self.post(s, "/abort_request", body) for s in targets))

    async def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Poll ``/health_generate`` on every server until all answer 200."""
        deadline = time.monotonic() + timeout_s
        pending = set(await self.workers()) if self.router else set(self.servers)
        last = ""
        while pending:
            for s in list(pending):
                try:
                    await self.get(s, "/health_generate")
                    pending.discard(s)
                except (aiohttp.ClientError, TimeoutError) as e:
                    last = f"{s}: {e}"
            if pending and time.monotonic() > deadline:
                raise RolloutError(f"servers not ready after {timeout_s:.0f} s: {sorted(pending)} ({last})")
            if pending:
                await asyncio.sleep(0.2)
