"""RolloutClient: the agent layer's ``generate`` over rollout servers (SGLang's API, or vLLM's).

Many servers (least-loaded choice, sticky per trajectory so a multi-step episode reuses its
server's prefix cache) or one ``sglang-router`` in front. Failed requests (connection errors,
5xx, timeouts) are retried on another server; 400s are the caller's fault and raise at once.
The same code drives real SGLang servers, the embedded engine and vLLM: what differs between their
APIs lives in one ``ServerAPI`` (``server_api.py``), chosen by ``api``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections import OrderedDict
from typing import Any

import aiohttp

from agent_r1.errors import AgentR1Error
from agent_r1.rollout.protocol import Completion, FinishReason, SamplingParams
from agent_r1.rollout.server_api import ServerAPI, server_api


class RolloutError(AgentR1Error, RuntimeError):
    """No server could serve a request; the message lists what each one said."""


class RequestRejected(AgentR1Error, ValueError):
    """The server answered 400: the request itself is invalid (message from the server)."""


async def probe(
    urls: list[str], path: str, timeout_s: float = 10.0, api_key: str | None = None, api: str = "embedded"
) -> list[Any]:
    """GET ``path`` on every server at once, no retries: each answer, or the exception it raised."""
    if not urls:
        return []
    client = RolloutClient(servers=urls, timeout_s=timeout_s, max_retries=0, api_key=api_key, api=api)
    try:
        return await asyncio.gather(*(client.get(u, path) for u in urls), return_exceptions=True)
    finally:
        await client.close()


async def server_versions(
    urls: list[str], api_key: str | None = None, api: str = "embedded"
) -> dict[str, int]:
    """Weight version of every server that answers (dead ones are left out)."""
    a = server_api(api)
    answers = await probe(urls, a.version_path, api_key=api_key, api=api)
    return {u: a.version(x) for u, x in zip(urls, answers, strict=True) if isinstance(x, dict)}


def to_completion(out: dict[str, Any]) -> Completion:
    """An SGLang ``/generate`` answer as a ``Completion``."""
    return server_api().completion(out)


MAX_RESENDS = 8  # how often one action may be interrupted by weight updates before it is kept aborted


def merged_spans(spans: list[list[int]]) -> list[list[int]]:
    """[[version, tokens], ...] with neighbours of one version joined and empty spans dropped."""
    out: list[list[int]] = []
    for v, n in spans:
        if n == 0:
            continue
        if out and out[-1][0] == v:
            out[-1][1] += n
        else:
            out.append([v, n])
    return out


class RolloutClient:
    def __init__(
        self,
        servers: list[str] | None = None,
        router: str | None = None,
        timeout_s: float = 600.0,
        max_retries: int = 3,
        cooldown_s: float = 5.0,
        api_key: str | None = None,
        api: str | ServerAPI = "embedded",
        interrupt_tokens: int | None = None,
    ):
        """``api_key``: sent as ``Authorization: Bearer KEY`` (servers started with ``--api-key``);
        ``api``: the servers' API (a ``rollout.engine`` name or a ``ServerAPI``);
        ``interrupt_tokens``: set by a training run's workers, whose weight pushes may interrupt a
        request (the embedded engine's ``drain`` pause past that many tokens, SGLang's ``abort``
        pause): an aborted action is then resent on the new weights, continued from its tokens so
        far when it has at least ``interrupt_tokens`` of them (> 0), else sampled again from the
        start, so every token is one version's and the spans say which. None: aborts are final."""
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
        self.api = server_api(api) if isinstance(api, str) else api
        self.interrupt_tokens = interrupt_tokens
        self.resent = 0  # actions resent after a weight update interrupted them

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
    async def generate_raw(
        self, payload: dict[str, Any], session: str | None = None, path: str = "/generate"
    ) -> Any:
        """POST a generate body with retries on other servers; returns the server's JSON."""
        return (await self._generate(path, payload, session))[1]

    async def _generate(self, path: str, payload: dict[str, Any], session: str | None) -> tuple[str, Any]:
        """(the server that answered, its JSON)."""
        rid = payload.setdefault(self.api.rid_field, uuid.uuid4().hex)
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
                return server, await self.post(server, path, payload)
            except aiohttp.ClientResponseError as e:
                if e.status == 400:
                    raise RequestRejected(f"{server} rejected the request: {e.message}") from None
                errors.append(f"{server}: HTTP {e.status} {e.message[:200]}")
            except (aiohttp.ClientConnectionError, TimeoutError) as e:
                why = str(e)
                if not why and isinstance(e, TimeoutError):  # its own message is empty
                    why = f"no answer within {self.timeout.total:g} s"
                errors.append(f"{server}: {type(e).__name__}: {why}")
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
        done = await self._complete(token_ids, sampling, session, images)
        if self.interrupt_tokens is None:
            return done
        ids: list[int] = []
        logprobs: list[float] = []
        spans: list[list[int]] = []
        for _ in range(MAX_RESENDS):
            if done.finish_reason is not FinishReason.ABORT:
                break
            self.resent += 1
            if 0 < self.interrupt_tokens <= len(done.token_ids):  # continue from its tokens so far
                ids += done.token_ids
                logprobs += done.logprobs
                spans.append([done.policy_version, len(done.token_ids)])
            left = sampling.max_new_tokens - len(ids)
            if left <= 0:  # its tokens so far are all it may have (a server ends it at the limit first)
                done = Completion([], [], FinishReason.LENGTH, done.policy_version)
                break
            more = dataclasses.replace(sampling, max_new_tokens=left)
            done = await self._complete(list(token_ids) + ids, more, session, images)
        if not spans:
            return done
        spans = merged_spans([*spans, [done.policy_version, len(done.token_ids)]])
        return Completion(
            ids + list(done.token_ids),
            logprobs + list(done.logprobs),
            done.finish_reason,
            spans[0][0],
            spans if len(spans) > 1 else [],
        )

    async def _complete(
        self,
        token_ids: list[int],
        sampling: SamplingParams,
        session: str | None,
        images: list[Any] | None,
    ) -> Completion:
        req = self.api.generate(token_ids, sampling, images)
        server, out = await self._generate(req.path, req.body, session)
        done = self.api.completion(out)
        if not self.api.version_in_answer:  # the weights it finished with: the server's version now
            try:
                info = await self.get(server, self.api.version_path)
            except (aiohttp.ClientError, TimeoutError) as e:
                raise RolloutError(
                    f"{server} answered, then its weight version could not be read: {e}"
                ) from None
            done.policy_version = max(self.api.version(info), 0)
        return done

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
        req = self.api.abort(rid)
        await asyncio.gather(*(self.post(s, req.path, req.body) for s in targets))

    async def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Poll the health route on every server until all answer 200."""
        deadline = time.monotonic() + timeout_s
        pending = set(await self.workers()) if self.router else set(self.servers)
        last = ""
        while pending:
            for s in list(pending):
                try:
                    await self.get(s, self.api.health_path)
                    pending.discard(s)
                except (aiohttp.ClientError, TimeoutError) as e:
                    last = f"{s}: {e}"
            if pending and time.monotonic() > deadline:
                raise RolloutError(f"servers not ready after {timeout_s:.0f} s: {sorted(pending)} ({last})")
            if pending:
                await asyncio.sleep(0.2)
