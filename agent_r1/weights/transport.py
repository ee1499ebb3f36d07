"""The interface every weight transport implements, and what they share.

A transport is the trainer's end of one way of getting weights into a set of servers: ``init``
(form whatever group the push needs), ``push(named, version, bucket_bytes)`` (every tensor, the new
version stamped and verified), ``close``. ``PushedServers`` keeps which servers have the pushed
weights; a server that misses an update is disabled in the generating client until it has them.
The transports: ``sglang.WeightUpdateGroup`` (SGLang's update sessions + a broadcast group; also
the embedded engine's), ``vllm.VLLMWeightPush`` (vLLM's weight-transfer API), ``disk`` (safetensors
on the shared filesystem). ``sender.WeightSender`` decides when and to whom.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable

import torch

from agent_r1.errors import AgentR1Error
from agent_r1.rollout.client import RolloutClient


class WeightSyncError(AgentR1Error, RuntimeError):
    """A weight push failed on at least one server (named in the message)."""


def release(text: str) -> tuple[int, ...] | None:
    """An engine's release number: ``"0.5.23"`` / ``"0.5.6.post2"`` / ``"0.5.21rc1"`` -> (0, 5, 23) /
    (0, 5, 6) / (0, 5, 21); None when it is not one."""
    m = re.match(r"^v?(\d+)\.(\d+)(?:\.(\d+))?", str(text).strip())
    if m is None:
        return None
    return tuple(int(g) for g in m.groups(default="0"))


def group_backend(tensors_on_cuda: bool) -> str:
    """NCCL when the weights live on a GPU (trainer and SGLang servers on GPU nodes), else gloo."""
    return "nccl" if tensors_on_cuda and torch.cuda.is_available() else "gloo"


class PushedServers:
    """What a weight push keeps about its servers: which have the pushed weights. A server that
    misses an update is disabled in the rollout client that generates until it has them."""

    servers: list[str]
    client: RolloutClient
    rollout_client: RolloutClient | None
    healthy: set[str]
    version_path = "/model_info"  # GET: {"weight_version": "N", ...}

    async def verify(self, version: int | str) -> None:
        answers = await asyncio.gather(
            *(self.client.get(s, self.version_path) for s in self.servers), return_exceptions=True
        )
        bad = [
            s
            for s, a in zip(self.servers, answers, strict=True)
            if isinstance(a, BaseException) or str(a.get("weight_version")) != str(version)
        ]
        self._set_healthy(set(self.servers) - set(bad))
        if bad:
            raise WeightSyncError(f"servers without weight version {version}: {bad}")

    def _set_healthy(self, healthy: set[str]) -> None:
        self.healthy = healthy
        if self.rollout_client is not None:
            self.rollout_client.disabled = set(self.servers) - healthy

    async def init(self, timeout_s: float = 120.0) -> None:
        raise NotImplementedError

    async def push(
        self, named: Iterable[tuple[str, torch.Tensor]], version: int | str, bucket_bytes: int = 512 << 20
    ) -> float:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError
