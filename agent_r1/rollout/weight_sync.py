"""Pushing new weights from a trainer process to rollout servers.

``WeightUpdateGroup`` is the trainer's end of SGLang's distributed update: the trainer is rank 0
of a standalone process group (gloo on CPU, NCCL on GPU) with every server; HF-named tensors go
in flattened buckets (one ``/update_weights_from_distributed`` call + one broadcast per bucket);
the last bucket carries the new ``weight_version``, which is then verified on every server. A
server that fails is reported and dropped from the group's healthy set until it has the version.
``push_weights_from_disk`` is the shared-filesystem alternative (safetensors +
``/update_weights_from_disk``).
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterable, Iterator
from datetime import timedelta
from pathlib import Path

import torch

from agent_r1.rollout.client import RolloutClient

DTYPE_NAMES = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.uint8: "uint8",
}


class WeightSyncError(RuntimeError):
    """A weight push failed on at least one server (named in the message)."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def buckets(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group tensors in order into buckets of at most ``bucket_bytes`` (a larger tensor goes alone)."""
    cur: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        n = t.numel() * t.element_size()
        if cur and size + n > bucket_bytes:
            yield cur
            cur, size = [], 0
        cur.append((name, t))
        size += n
    if cur:
        yield cur


def flatten(bucket: list[tuple[str, torch.Tensor]], device: torch.device | str = "cpu") -> torch.Tensor:
    """One uint8 tensor of the bucket's bytes on ``device``: the GPU for NCCL (no host copy), the
    CPU for gloo."""
    return torch.cat([t.detach().contiguous().to(device).view(-1).view(torch.uint8) for _, t in bucket])


def group_backend(tensors_on_cuda: bool) -> str:
    """NCCL when the weights live on a GPU (trainer and SGLang servers on GPU nodes), else gloo."""
    return "nccl" if tensors_on_cuda and torch.cuda.is_available() else "gloo"


class WeightUpdateGroup:
    def __init__(
        self,
        servers: list[str],
        master_address: str = "127.0.0.1",
        backend: str = "gloo",
        group_name: str = "weight_update_group",
        rollout_client: RolloutClient | None = None,
        api_key: str | None = None,
    ):
        """``rollout_client``: the client that generates; servers that miss an update are disabled
        in it until they have the new version."""
        self.servers = [s.rstrip("/") for s in servers]
        self.rollout_client = rollout_client
        self.master_address, self.backend, self.group_name = master_address, backend, group_name
        self.client = RolloutClient(servers=self.servers, api_key=api_key)
        self.group = None
        self.healthy = set(self.servers)
        # NCCL broadcasts from GPU memory (this rank's current device), gloo from host memory
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        )

    async def init(self, timeout_s: float = 120.0) -> None:
        """Create the group: servers join over HTTP while this process joins as rank 0."""
        import torch.distributed as dist

        port = free_port(self.master_address)
        world = 1 + len(self.servers)
        result: dict[str, object] = {}

        def join() -> None:
            try:
                store = dist.TCPStore(
                    self.master_address, port, world, is_master=True, timeout=timedelta(seconds=timeout_s)
                )
                store = dist.PrefixStore(self.group_name, store)
                cls = dist.ProcessGroupGloo if self.backend == "gloo" else dist.ProcessGroupNCCL
                result["group"] = cls(store, 0, world)
            except Exception as e:  # noqa: BLE001 - re-raised below with context
                result["error"] = e

        t = threading.Thread(target=join, daemon=True)
        t.start()
        bodies = [
            {
                "master_address": self.master_address,
                "master_port": port,
                "rank_offset": 1 + i,
                "world_size": world,
                "group_name": self.group_name,
                "backend": self.backend,
            }
            for i in range(len(self.servers))
        ]
        answers = await asyncio.gather(
            *(
                self.client.post(s, "/init_weights_update_group", b)
                for s, b in zip(self.servers, bodies, strict=True)
            ),
            return_exceptions=True,
        )
        await asyncio.to_thread(t.join, timeout_s)
        bad = [
            f"{s}: {a}"
            for s, a in zip(self.servers, answers, strict=True)
            if isinstance(a, BaseException) or not a.get("success")
        ]
        if bad or "error" in result:
            raise WeightSyncError(f"weight update group failed: {bad or result.get('error')}")
        self.group = result["group"]

    async def push(
        self, named: Iterable[tuple[str, torch.Tensor]], version: int | str, bucket_bytes: int = 512 << 20
    ) -> float:
        """Send every tensor; returns seconds taken. Raises WeightSyncError naming failed servers."""
        if self.group is None:
            raise WeightSyncError("call init() before push()")
        import time

        t0 = time.perf_counter()
        all_buckets = list(buckets(named, bucket_bytes))
        for i, bucket in enumerate(all_buckets):
            body = {
                "names": [n for n, _ in bucket],
                "dtypes": [DTYPE_NAMES[t.dtype] for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket],
                "group_name": self.group_name,
                "load_format": "flattened_bucket",
                "flush_cache": True,
                "weight_version": str(version) if i == len(all_buckets) - 1 else None,
            }
            flat = flatten(bucket, self.device)
            calls = [
                asyncio.ensure_future(self.client.post(s, "/update_weights_from_distributed", body))
                for s in self.servers
            ]
            try:
                await asyncio.to_thread(lambda f=flat: self.group.broadcast(f, 0).wait())
            finally:
                answers = await asyncio.gather(*calls, return_exceptions=True)
            bad = [
                f"{s}: {a}"
                for s, a in zip(self.servers, answers, strict=True)
                if isinstance(a, BaseException) or not a.get("success")
            ]
            if bad:
                failed = {
                    s
                    for s, a in zip(self.servers, answers, strict=True)
                    if isinstance(a, BaseException) or not a.get("success")
                }
                self._set_healthy(set(self.servers) - failed)
                raise WeightSyncError(f"weight update (bucket {i + 1}/{len(all_buckets)}) failed on: {bad}")
        await self.verify(version)
        return time.perf_counter() - t0

    async def verify(self, version: int | str) -> None:
        answers = await asyncio.gather(
            *(self.client.get(s, "/get_model_info") for s in self.servers), return_exceptions=True
        )
        bad = [
            s
            for s, a in zip(self.servers, answers, strict=True)
            if isinstance(a, BaseException) or a.get("weight_version") != str(version)
        ]
        self._set_healthy(set(self.servers) - set(bad))
        if bad:
            raise WeightSyncError(f"servers without weight version {version}: {bad}")

    def _set_healthy(self, healthy: set[str]) -> None:
        self.healthy = healthy
        if self.rollout_client is not None:
            self.rollout_client.disabled = set(self.servers) - healthy

    async def close(self) -> None:
        await asyncio.gather(
            *(
                self.client.post(s, "/destroy_weights_update_group", {"group_name": self.group_name})
                for s in self.servers
            ),
            return_exceptions=True,
        )
        await self.client.close()
        self.group = None


async def push_weights_from_disk(
    servers: list[str],
    named: Iterable[tuple[str, torch.Tensor]] | None,
    out_dir: str | Path,
    version: int | str,
    api_key: str | None = None,
) -> None:
    """Write ``model.safetensors`` under ``out_dir`` (shared filesystem) and have every server load
    it; ``named=None`` only has the servers load what ``out_dir`` already holds (a late server)."""
    out = Path(out_dir)
    if named is not None:
        from safetensors.torch import save_file

        out.mkdir(parents=True, exist_ok=True)
        tmp = out / ".model.safetensors.tmp"
        save_file({n: t.detach().contiguous().cpu() for n, t in named}, str(tmp))
        tmp.replace(out / "model.safetensors")
    client = RolloutClient(servers=servers, api_key=api_key)
    try:
        answers = await asyncio.gather(
            *(
                client.post(
                    s, "/update_weights_from_disk", {"model_path": str(out), "weight_version": str(version)}
                )
                for s in servers
            ),
            return_exceptions=True,
        )
    finally:
        await client.close()
    bad = [
        f"{s}: {a}"
        for s, a in zip(servers, answers, strict=True)
        if isinstance(a, BaseException) or not a.get("success")
    ]
    if bad:
        raise WeightSyncError(f"update_weights_from_disk failed on: {bad}")


# ---- colocated: CUDA IPC handles (SGLang's /update_weights_from_tensor) ------------------------------
def serialize_named_tensors(named: dict[str, torch.Tensor]) -> str:
    """``[(name, tensor), ...]`` pickled with torch's multiprocessing reductions, base64: a CUDA
    tensor becomes an IPC handle into this process's memory (a CPU tensor moves to shared memory),
    so the receiver maps the same bytes. Keep the tensors alive until the receiver has answered."""
    import base64
    import io
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 - registers the tensor reductions with ForkingPickler

    buf = io.BytesIO()
    ForkingPickler(buf, 4).dump([(n, t.detach().contiguous()) for n, t in named.items()])
    return base64.b64encode(buf.getvalue()).decode()


def deserialize_named_tensors(blob: str) -> dict[str, torch.Tensor]:
    import base64
    import pickle

    import torch.multiprocessing  # noqa: F401 - registers the reductions the pickle refers to

    return dict(pickle.loads(base64.b64decode(blob)))


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

    body = {
        "serialized_named_tensors": [serialize_named_tensors(named)],
        "flush_cache": True,
        "weight_version": str(version),
    }
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(
        url.rstrip("/") + "/update_weights_from_tensor", json.dumps(body).encode(), headers
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            answer = json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise WeightSyncError(
            f"{url}: /update_weights_from_tensor answered {e.code}: {e.read()[:500]!r}"
        ) from None
    if not answer.get("success"):
        raise WeightSyncError(f"{url}: /update_weights_from_tensor failed: {answer.get('message')}")
