"""Models a process can ask by name: the policy and the run's helper models.

A run serves helper models beside the policy, each by its own role (``rollout.helpers``:
``{selector: HF_DIR, summarizer: HF_DIR}``; ``algorithm.teacher`` is the helper named
``teacher``). Each publishes its address under ``control/<name>s/`` like the policy's servers
under ``control/servers/``; the addresses are read at every use, so a restarted helper is found
again. ``run_models`` gives them by name; code that needs one (the paper-search LLM judge, the
summarising context) asks its environment's ``Services.model(name)``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agent_r1.http_service import published_urls, read_ready
from agent_r1.rollout.client import RolloutClient

log = logging.getLogger(__name__)

# names a helper model may not take: the roles of a run (agent_r1.launch.roles.ROLES, a test keeps
# them in step) and the policy
RESERVED = ("server", "worker", "learner", "router", "retriever", "env_server", "policy")


@dataclass(frozen=True)
class ServedModel:
    name: str
    model: str  # HF folder: its tokenizer encodes the prompts
    urls: Callable[[], list[str]]
    api_key: str | None = None
    wait_s: float = 300.0
    api: str = "embedded"  # the servers' engine (its API: engine_spec)

    async def client(self, timeout_s: float = 300.0) -> RolloutClient:
        """A client over the model's current servers; waits up to ``wait_s`` for the first one."""
        deadline = time.monotonic() + self.wait_s
        while not (urls := self.urls()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"no server of the {self.name!r} model came up within {self.wait_s:.0f}s")
            await asyncio.sleep(0.5)
        return RolloutClient(servers=urls, timeout_s=timeout_s, api_key=self.api_key, api=self.api)


def helper_models(cfg: Any) -> dict[str, str]:
    """The run's helper models, name -> HF folder (``rollout.helpers`` + the OPD teacher)."""
    out = dict(cfg.rollout.helpers)
    if cfg.algorithm.teacher:
        out["teacher"] = cfg.algorithm.teacher
    return out


def run_models(cfg: Any, rd: Any) -> dict[str, ServedModel]:
    """The run's policy (its router when ``rollout.router``) and every helper model, by name. Their
    addresses are read at every use: nothing is asked before an episode needs it."""
    key, wait = rd.api_key(), cfg.rollout.ready_timeout_s
    urls = (lambda: _router(rd)) if cfg.rollout.router else (lambda: published_urls(rd.servers))
    models = {"policy": ServedModel("policy", cfg.model.path, urls, key, wait, cfg.rollout.engine)}
    for name, path in helper_models(cfg).items():
        models[name] = ServedModel(
            name, path, functools.partial(published_urls, rd.helper_dir(name)), key, wait
        )
    if helper_models(cfg):
        log.info("helper models of the run: %s", ", ".join(sorted(helper_models(cfg))))
    return models


def _router(rd: Any) -> list[str]:
    url = read_ready(rd.router_file)
    return [url] if url else []
