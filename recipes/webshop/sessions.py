"""A shopper's session as the environment sees it: in this process (``LocalSession``) or on a
WebShop environment server (``RemoteSession``, ``agent-r1 env serve webshop``). Both keep the same
snapshot after every action: the page, its observation, the available actions, the page's state
key (GiGPO's anchor) and, once bought, the score and its parts.

A remote session opens on the server at its first action (a fresh session's search page needs no
server: it shows the instruction only). Requests are retried with back-off; a server that stays
unreachable raises ``EnvServerError``, which ends the episode as an environment error (the
trajectory is counted and dropped, never trained on).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from agent_r1.errors import AgentR1Error
from recipes.webshop.catalog import Goal
from recipes.webshop.shop import Session, Shop


class EnvServerError(AgentR1Error, RuntimeError):
    """The environment server could not be reached (after retries) or answered nonsense."""


@dataclass
class Snapshot:
    page: str
    observation: str
    actions: list[str]
    key: str
    reward: float | None = None
    reward_info: dict[str, Any] = field(default_factory=dict)


def snapshot(shop: Shop, s: Session) -> Snapshot:
    return Snapshot(s.page, shop.observation(s), shop.available_actions(s), shop.state_key(s), s.reward,
                    dict(s.reward_info))  # fmt: skip


def first_snapshot(goal: Goal) -> Snapshot:
    """The search page of a fresh session (the same on every server)."""
    s = Session(goal)
    return Snapshot("search", f"WebShop [SEP] Instruction: [SEP] {goal.instruction_text} [SEP] Search",
                    ["search[<your query>]"], Shop.state_key(s))  # fmt: skip


class LocalSession:
    def __init__(self, shop: Shop, goal: Goal):
        self.shop, self.goal, self.session = shop, goal, Session(goal)
        self.snap = snapshot(shop, self.session)

    async def act(self, command: str) -> tuple[bool, str]:
        ok, why = self.shop.step(self.session, command)
        self.snap = snapshot(self.shop, self.session)
        return ok, why

    async def close(self) -> None:
        pass


class RemoteSession:
    RETRIES = 3

    def __init__(self, url: str, goal: Goal, api_key: str | None = None, timeout_s: float = 30.0):
        self.url, self.goal, self.timeout_s = url.rstrip("/"), goal, timeout_s
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.id: str | None = None
        self.snap = first_snapshot(goal)
        self._http: Any = None

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        import aiohttp

        if self._http is None:
            self._http = aiohttp.ClientSession(
                headers=self.headers, timeout=aiohttp.ClientTimeout(total=self.timeout_s)
            )
        last = ""
        for attempt in range(self.RETRIES):
            try:
                async with self._http.post(self.url + path, json=body) as r:
                    data = await r.json(content_type=None)
                    if r.status == 200:
                        return data
                    if r.status == 404 and path == "/step":  # the server restarted: the session is gone
                        raise EnvServerError(f"{self.url}: session {self.id} is gone ({data.get('error')})")
                    last = f"{r.status}: {data.get('error', data)}"
                    if r.status < 500:
                        raise EnvServerError(f"{self.url}{path} refused the request ({last})")
            except (aiohttp.ClientError, TimeoutError, ValueError) as e:
                last = f"{type(e).__name__}: {e}"
            await asyncio.sleep(0.2 * 2**attempt)
        raise EnvServerError(f"environment server {self.url} unreachable after {self.RETRIES} tries ({last})")

    async def act(self, command: str) -> tuple[bool, str]:
        if self.id is None:
            self.id = (await self._post("/reset", {"goal": self.goal.to_json()}))["session"]
        out = await self._post("/step", {"session": self.id, "action": command})
        self.snap = Snapshot(**out["snapshot"])
        return bool(out["valid"]), out.get("message", "")

    async def close(self) -> None:
        if self._http is not None:
            if self.id is not None:
                try:
                    await self._post("/close", {"session": self.id})
                except EnvServerError:
                    pass  # a dead server keeps nothing anyway
            await self._http.close()
            self._http = None
