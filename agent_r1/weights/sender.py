"""``WeightSender``: the whole weight push policy, sender side (the receiving end of the embedded
engine is ``receiver.py``; the transports are ``sglang.py``, ``vllm.py`` and ``disk.py``, the
engine's entry in ``engine_spec`` says which).

Which servers get the weights (the published ones that answer), the update group (formed once,
re-formed when its members change), a failed push retried once with the servers still alive, a
restarted or late server brought to the current version in a short-lived group of its own so the
others keep generating, and disk pushes (``weights/vN``, older versions pruned).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from pathlib import Path
from typing import Any

from agent_r1.engine_spec import engine_spec
from agent_r1.errors import RoleTimeout
from agent_r1.http_service import published_urls
from agent_r1.rollout.client import probe, server_versions
from agent_r1.weights.disk import push_weights_from_disk
from agent_r1.weights.transport import PushedServers, WeightSyncError, group_backend

log = logging.getLogger("agent_r1.publisher")


class WeightSender:
    RESYNC_EVERY_S = 2.0  # how often a waiting coordinator looks for servers that lack the weights

    def __init__(
        self,
        rollout: Any,
        servers_dir: Path,
        weights_dir: Path,
        address: str,
        api_key: str | None = None,
        alive: Any = None,
    ):
        """``rollout``: the run's rollout slice (``engine``, ``weight_sync``, ``bucket_mb``,
        ``ready_timeout_s``); ``servers_dir``: where the servers publish their addresses;
        ``weights_dir``: the disk pushes' ``vN`` folders; ``address``: this node's, where the
        servers join the update group; ``alive()``: called while waiting for servers."""
        self.rollout, self.servers_dir, self.weights_dir = rollout, Path(servers_dir), Path(weights_dir)
        self.address, self.api_key, self.alive = address, api_key, alive
        self.api = rollout.engine  # the servers' API is the engine's (``engine_spec``)
        self.transport: type[PushedServers] = engine_spec(rollout.engine).load("transport")
        self.loop = asyncio.new_event_loop()
        self.group: PushedServers | None = None
        self.group_servers: list[str] = []
        # the weights the servers must have: a restarted or new server is brought to them
        self.pushed: tuple[int, dict[str, Any]] | None = None
        self.backend = "gloo"  # of the weight-update group; NCCL once weights are on a GPU
        self.last_push: dict[str, float] = {}

    def resync(self, min_version: int) -> int:
        """Push the current weights to every live server that lacks them (a restarted server starts
        from the model on disk); returns how many live servers have at least ``min_version``."""
        urls = published_urls(self.servers_dir)
        versions = self.loop.run_until_complete(server_versions(urls, self.api_key, self.api))
        if self.pushed is not None:
            version, named = self.pushed
            late = [u for u, v in versions.items() if v < version]
            if late:
                log.warning("servers %s lack weight version %d: pushing it to them", late, version)
                try:
                    self._push_to(late, named, version, late=True)
                    versions.update(dict.fromkeys(late, version))
                except (WeightSyncError, RuntimeError, OSError) as e:
                    log.warning("bringing %s to version %d failed (%s); trying again", late, version, e)
        return sum(v >= min_version for v in versions.values())

    def live_servers(self) -> list[str]:
        """Published servers that answer /health (a dead one's file is ignored)."""

        urls = published_urls(self.servers_dir)
        answers = self.loop.run_until_complete(probe(urls, "/health", api_key=self.api_key))
        return [u for u, a in zip(urls, answers, strict=True) if not isinstance(a, BaseException)]

    def push(self, named: dict[str, Any], version: int, on_gpu: bool | None = None) -> float:
        """Send the policy to every live server; a failed push is retried once with the servers
        that are still alive (a dead server drops out, a replaced one joins). ``on_gpu``: the
        learner trains on GPUs (its weights wait in host memory; each bucket goes to the GPU and
        out over NCCL); None: wherever the tensors are."""

        t0 = time.perf_counter()
        self.pushed = (version, named)
        # NCCL from a GPU learner (bucket by bucket through its GPU), gloo from a CPU one
        on_gpu = any(t.is_cuda for t in named.values()) if on_gpu is None else on_gpu
        self.backend = group_backend(on_gpu)
        for attempt in range(2):
            servers = self._wait_servers()
            try:
                self._push_to(servers, named, version)
                seconds = time.perf_counter() - t0
                nbytes = sum(t.numel() * t.element_size() for t in named.values())
                self.last_push = {"seconds": seconds, "gbps": nbytes / max(seconds, 1e-9) / 1e9}
                log.info(
                    "weights v%d: %.2f GB (%d bytes) to %d server(s) in %.2f s (%.2f GB/s, %s, %s)",
                    version,
                    nbytes / 1e9,
                    nbytes,
                    len(servers),
                    seconds,
                    self.last_push["gbps"],
                    self.rollout.engine,
                    self.rollout.weight_sync if self.rollout.weight_sync == "disk" else self.backend,
                )
                return seconds
            except (WeightSyncError, RuntimeError, OSError) as e:
                log.warning("weight push v%d failed (%s); retrying with the live servers", version, e)
                self._drop_group()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _push_to(self, servers: list[str], named: dict[str, Any], version: int, late: bool = False) -> None:
        """Disk: write ``weights/vN`` once, every server loads it. Distributed: the run's update
        group (re-formed when its members change); ``late`` servers get their own short-lived group
        so the others keep generating."""
        if self.rollout.weight_sync == "disk":
            out = self.weights_dir / f"v{version:06d}"
            fresh = not late or not (out / "model.safetensors").exists()
            self.loop.run_until_complete(
                push_weights_from_disk(
                    servers, named.items() if fresh else None, out, version, api_key=self.api_key
                )
            )
            self._prune_weights(version)
        elif late:
            group = self._group(servers, f"late_{version}_{time.time_ns()}")
            try:
                self.loop.run_until_complete(group.init(timeout_s=self.rollout.ready_timeout_s))
                self.loop.run_until_complete(group.push(named.items(), version, self.rollout.bucket_mb << 20))
            finally:
                self.loop.run_until_complete(asyncio.wait_for(group.close(), 30))
        else:
            self._ensure_group(servers)
            self.loop.run_until_complete(
                self.group.push(named.items(), version, self.rollout.bucket_mb << 20)
            )

    def _wait_servers(self) -> list[str]:
        deadline = time.time() + self.rollout.ready_timeout_s
        while True:
            servers = self.live_servers()
            if servers:
                return servers
            if self.alive is not None:
                self.alive()
            if time.time() > deadline:
                raise RoleTimeout(f"no rollout server answered within {self.rollout.ready_timeout_s:.0f} s")
            time.sleep(0.2)

    def _ensure_group(self, servers: list[str]) -> None:

        if self.group is not None and sorted(servers) == sorted(self.group_servers):
            return
        self._drop_group()

        self.group = self._group(servers, "weight_update_group")
        self.loop.run_until_complete(self.group.init(timeout_s=self.rollout.ready_timeout_s))
        self.group_servers = list(servers)
        log.info("weight update group with %d server(s)", len(servers))

    def _group(self, servers: list[str], name: str):
        return self.transport(
            servers,
            self.address,
            self.backend,
            name,
            api_key=self.api_key,
            interrupt_tokens=self.rollout.interrupt_tokens,
        )

    def _drop_group(self) -> None:
        if self.group is not None:
            try:
                self.loop.run_until_complete(asyncio.wait_for(self.group.close(), 30))
            except Exception as e:  # noqa: BLE001 - a dead member cannot leave cleanly
                log.debug("closing the weight update group: %s", e)
        self.group, self.group_servers = None, []

    def _prune_weights(self, version: int) -> None:
        for p in self.weights_dir.glob("v*"):
            if p.name[1:].isdigit() and int(p.name[1:]) < version - 1:
                shutil.rmtree(p, ignore_errors=True)

    def close(self) -> None:
        self._drop_group()
        self.loop.close()
