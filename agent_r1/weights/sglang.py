"""SGLang's weight push (the embedded engine's too): the trainer's end of its update sessions.

``WeightUpdateGroup`` is the trainer's end of SGLang's distributed update. Every rank of every
server joins a standalone process group (gloo on CPU, NCCL on GPU) with the trainer as rank 0; both
ends join through the same calls as SGLang's ``init_custom_process_group``
(``sglang/srt/utils/common.py``: a ``tcp://`` rendezvous, the store prefixed with the group name,
then torch's ``_new_process_group_helper``, which prefixes it again), so their store keys meet. A
server of TP size ``t`` joins with ranks ``rank_offset .. rank_offset + t - 1``.

One push is one session on every server: ``/pause_generation`` (step-atomic: the embedded engine
drains, every running action finishing on its version; SGLang aborts them and the workers resend
them on the new weights; ``ServerProtocol.pause_body``), ``/begin_weight_update`` (SGLang >= 0.5.21
refuses updates outside a session), one ``/update_weights_from_distributed`` + broadcast per
flattened bucket (``flush_cache=false``; the last bucket carries the new ``weight_version``),
``/end_weight_update``, one ``/flush_cache``, ``/continue_generation``; then the version is verified.
A server that fails is reported and dropped from the group's healthy set until it has the version.
``push_weights_from_disk`` is the shared-filesystem alternative (safetensors +
``/update_weights_from_disk``).
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import aiohttp
import torch

from agent_r1.process import free_port
from agent_r1.rollout.client import RolloutClient
from agent_r1.weights.buckets import DTYPE_NAMES, buckets, flatten, serialize_named_tensors
from agent_r1.weights.transport import PushedServers, WeightSyncError, release
from agent_r1.weights.update_group import join_update_group, leave_update_group

# The SGLang releases whose weight-update protocol this module speaks (checked by the contract
# tests against each end of the window): flattened buckets (``load_format``) from 0.5.6, update
# sessions required from 0.5.21. The ``gpu`` extra pins the same window.
SGLANG_OLDEST = (0, 5, 6)
SGLANG_BELOW = (0, 6)
SGLANG_SESSIONS_FROM = (0, 5, 21)


def window_text() -> str:
    return f"{'.'.join(map(str, SGLANG_OLDEST))} <= version < {'.'.join(map(str, SGLANG_BELOW))}"


@dataclass(frozen=True)
class ServerProtocol:
    """What one server's ``/server_info`` says about how to update it."""

    url: str
    version: str
    tp_size: int = 1
    drain: bool = False  # the embedded engine's step-atomic pause (``pause_modes`` in /server_info)

    def pause_body(self, interrupt_tokens: int) -> dict:
        """How a push pauses this server. Step-atomic either way: the embedded engine drains
        (running actions finish on their version; past ``interrupt_tokens`` they are interrupted);
        SGLang has no drain, so its in-flight actions are aborted and the workers' client resends
        them on the new weights (from their tokens so far past ``interrupt_tokens``)."""
        if self.drain:
            return {"mode": "drain", "interrupt_tokens": int(interrupt_tokens)}
        return PAUSE_BODY

    @property
    def sessions(self) -> bool:
        v = release(self.version)
        return v is not None and v >= SGLANG_SESSIONS_FROM


def check_server_info(url: str, info: Any) -> ServerProtocol:
    """The update protocol of a server from its ``/server_info``; a release outside the supported
    window, or a layout whose ranks SGLang would number twice (``dp_size`` or ``pp_size`` > 1: every
    replica / stage joins as ``rank_offset + tp_rank``), is refused naming the server."""
    if not isinstance(info, dict):
        raise WeightSyncError(f"{url}: /server_info answered {str(info)[:200]!r}, not a JSON object")
    version = str(info.get("version", ""))
    v = release(version)
    if v is None or not (SGLANG_OLDEST <= v < SGLANG_BELOW):
        raise WeightSyncError(
            f"{url} runs SGLang {version or '(no version in /server_info)'}; the distributed weight push "
            f"supports {window_text()} (pip install 'sglang>={'.'.join(map(str, SGLANG_OLDEST))},"
            f"<{'.'.join(map(str, SGLANG_BELOW))}'), or set rollout.weight_sync=disk"
        )
    for key in ("dp_size", "pp_size"):
        if int(info.get(key) or 1) > 1:
            raise WeightSyncError(
                f"{url}: {key}={info[key]}: SGLang numbers the update-group ranks rank_offset + tp_rank, "
                f"so its replicas / stages would share ranks; run one server per replica "
                f"(rollout.sglang.tp only) or set rollout.weight_sync=disk"
            )
    drain = "drain" in (info.get("pause_modes") or ())
    return ServerProtocol(url, version, int(info.get("tp_size") or 1), drain)


def bucket_body(bucket: list[tuple[str, torch.Tensor]], group_name: str, version: str | None) -> dict:
    """The ``/update_weights_from_distributed`` body of one flattened bucket (SGLang's
    ``UpdateWeightsFromDistributedReqInput``); the cache is flushed once after the last bucket."""
    return {
        "names": [n for n, _ in bucket],
        "dtypes": [DTYPE_NAMES[t.dtype] for _, t in bucket],
        "shapes": [list(t.shape) for _, t in bucket],
        "group_name": group_name,
        "load_format": "flattened_bucket",
        "flush_cache": False,
        "weight_version": version,
    }


# the control calls of one push, in order (bodies as SGLang's request types take them)
PAUSE_BODY = {"mode": "abort"}  # SGLang's: in-flight requests come back aborted, and are resent
BEGIN_BODY: dict = {}
END_BODY: dict = {}
CONTINUE_BODY: dict = {}


async def server_protocols(client: RolloutClient, servers: list[str]) -> list[ServerProtocol]:
    async def one(url: str) -> ServerProtocol:
        try:
            info = await client.get(url, "/server_info")
        except aiohttp.ClientResponseError as e:
            if e.status != 404:
                raise WeightSyncError(f"{url}: /server_info answered {e.status}: {e.message[:200]}") from None
            info = await client.get(url, "/get_server_info")  # releases before /server_info
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            raise WeightSyncError(f"{url}: /server_info unreachable: {e}") from None
        return check_server_info(url, info)

    return list(await asyncio.gather(*(one(s) for s in servers)))


class WeightUpdateGroup(PushedServers):
    def __init__(
        self,
        servers: list[str],
        master_address: str = "127.0.0.1",
        backend: str = "gloo",
        group_name: str = "weight_update_group",
        rollout_client: RolloutClient | None = None,
        api_key: str | None = None,
        interrupt_tokens: int = 0,
    ):
        """``rollout_client``: the client that generates; servers that miss an update are disabled
        in it until they have the new version. ``group_name`` is a prefix: every (re-)formed group
        gets a fresh name (torch refuses a process-group name twice in one process)."""
        self.servers = [s.rstrip("/") for s in servers]
        self.rollout_client = rollout_client
        self.master_address, self.backend, self.prefix = master_address, backend, group_name
        self.interrupt_tokens = interrupt_tokens  # see ``ServerProtocol.pause_body``
        self.group_name = group_name
        self.client = RolloutClient(servers=self.servers, api_key=api_key)
        self.group = None
        self.protocols: dict[str, ServerProtocol] = {}
        self.healthy = set(self.servers)
        # NCCL broadcasts from GPU memory (this rank's current device), gloo from host memory
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        )

    def init_bodies(self, port: int) -> list[dict]:
        """One ``/init_weights_update_group`` body per server: rank offsets count every TP rank."""
        world = 1 + sum(self.protocols[s].tp_size for s in self.servers)
        bodies, offset = [], 1
        for s in self.servers:
            bodies.append(
                {
                    "master_address": self.master_address,
                    "master_port": port,
                    "rank_offset": offset,
                    "world_size": world,
                    "group_name": self.group_name,
                    "backend": self.backend,
                }
            )
            offset += self.protocols[s].tp_size
        return bodies

    @staticmethod
    def _failed(servers: list[str], answers: list[Any]) -> dict[str, str]:
        """Server -> what went wrong, for the answers that are errors or ``success: false``."""
        return {
            s: str(a) if isinstance(a, BaseException) else str(a.get("message", a))
            for s, a in zip(servers, answers, strict=True)
            if isinstance(a, BaseException) or (isinstance(a, dict) and a.get("success") is False)
        }

    async def _control(
        self, path: str, body: dict | Callable[[str], dict], servers: list[str]
    ) -> dict[str, str]:
        """POST ``body`` (or ``body(server)``) to every server at once: server -> what failed."""
        answers = await asyncio.gather(
            *(self.client.post(s, path, body(s) if callable(body) else body) for s in servers),
            return_exceptions=True,
        )
        return {s: f"{path}: {why}" for s, why in self._failed(servers, answers).items()}

    async def init(self, timeout_s: float = 120.0) -> None:
        """Create the group: servers join over HTTP while this process joins as rank 0."""
        self.protocols = {p.url: p for p in await server_protocols(self.client, self.servers)}
        self.group_name = f"{self.prefix}_{uuid.uuid4().hex[:12]}"
        port = free_port(self.master_address)
        bodies = self.init_bodies(port)
        result: dict[str, object] = {}

        def join() -> None:
            try:
                result["group"] = join_update_group(
                    self.backend,
                    self.master_address,
                    port,
                    bodies[0]["world_size"],
                    0,
                    self.group_name,
                    timeout_s,
                )
            except Exception as e:  # noqa: BLE001 - re-raised below with context
                result["error"] = e

        t = threading.Thread(target=join, daemon=True)
        t.start()
        answers = await asyncio.gather(
            *(
                self.client.post(s, "/init_weights_update_group", b)
                for s, b in zip(self.servers, bodies, strict=True)
            ),
            return_exceptions=True,
        )
        await asyncio.to_thread(t.join, timeout_s)
        bad = self._failed(self.servers, answers)
        if bad or "error" in result:
            if "group" in result:
                leave_update_group(result["group"])
            raise WeightSyncError(f"weight update group failed: {bad or result.get('error')}")
        self.group = result["group"]

    async def push(
        self, named: Iterable[tuple[str, torch.Tensor]], version: int | str, bucket_bytes: int = 512 << 20
    ) -> float:
        """Send every tensor in one update session per server; returns seconds taken. Raises
        WeightSyncError naming failed servers (they stay out of the healthy set until verified)."""
        if self.group is None:
            raise WeightSyncError("call init() before push()")
        import time

        import torch.distributed as dist

        t0 = time.perf_counter()
        all_buckets = list(buckets(named, bucket_bytes))
        sessions = [s for s in self.servers if self.protocols[s].sessions]
        failed = await self._control(
            "/pause_generation", lambda s: self.protocols[s].pause_body(self.interrupt_tokens), self.servers
        )
        failed |= await self._control("/begin_weight_update", BEGIN_BODY, sessions)
        where = "starting the update session"
        try:
            for i, bucket in enumerate([] if failed else all_buckets):
                where = f"bucket {i + 1}/{len(all_buckets)}"
                last = i == len(all_buckets) - 1
                body = bucket_body(bucket, self.group_name, str(version) if last else None)
                flat = flatten(bucket, self.device)
                calls = [
                    asyncio.ensure_future(self.client.post(s, "/update_weights_from_distributed", body))
                    for s in self.servers
                ]
                try:
                    await asyncio.to_thread(lambda f=flat: dist.broadcast(f, src=0, group=self.group))
                finally:
                    answers = await asyncio.gather(*calls, return_exceptions=True)
                failed |= self._failed(self.servers, answers)
                if failed:
                    break
        finally:
            # close the session, drop the KV computed with the old weights, let generation go on
            end = await self._control("/end_weight_update", END_BODY, sessions)
            end |= await self._control("/flush_cache", {}, self.servers)
            end |= await self._control("/continue_generation", CONTINUE_BODY, self.servers)
        if failed or end:
            self._set_healthy(set(self.servers) - set(failed) - set(end))
            raise WeightSyncError(
                f"weight update ({where if failed else 'closing the session'}) failed on: {failed or end}"
            )
        await self.verify(version)
        return time.perf_counter() - t0

    async def close(self) -> None:
        await asyncio.gather(
            *(
                self.client.post(s, "/destroy_weights_update_group", {"group_name": self.group_name})
                for s in self.servers
            ),
            return_exceptions=True,
        )
        await self.client.close()
        if self.group is not None:
            leave_update_group(self.group)
        self.group = None


# ---- colocated: CUDA IPC handles (SGLang's /update_weights_from_tensor) ------------------------------
def push_weights_ipc(
    url: str,
    named: dict[str, torch.Tensor],
    version: int | str,
    timeout_s: float = 600.0,
    api_key: str | None = None,
) -> None:
    """Update a colocated server (same machine; same GPU for CUDA tensors) through
    ``/update_weights_from_tensor``; the server copies from the shared memory into its weights.
    Raises ``WeightSyncError`` with the server's message on failure."""
    import json
    import urllib.error
    import urllib.request

    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"

    def call(path: str, body: dict | None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url.rstrip("/") + path, data, headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise WeightSyncError(f"{url}: {path} answered {e.code}: {e.read()[:500]!r}") from None

    protocol = check_server_info(url, call("/server_info", None))
    body = {
        "serialized_named_tensors": [serialize_named_tensors(named)],
        "flush_cache": True,
        "weight_version": str(version),
    }
    if protocol.sessions:
        answer = call("/begin_weight_update", BEGIN_BODY)
        if answer.get("success") is False:
            raise WeightSyncError(f"{url}: /begin_weight_update failed: {answer.get('message')}")
    try:
        answer = call("/update_weights_from_tensor", body)
    finally:
        if protocol.sessions:
            call("/end_weight_update", END_BODY)
    if not answer.get("success"):
        raise WeightSyncError(f"{url}: /update_weights_from_tensor failed: {answer.get('message')}")
