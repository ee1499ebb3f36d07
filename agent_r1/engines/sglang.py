"""Real SGLang servers (GPU nodes): the launch command from the run's config, start-up with a
bounded wait on ``/health_generate``, then the same published address file as the embedded server,
so clients, workers and the coordinator cannot tell them apart."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from agent_r1.engines.upstream import UpstreamServer
from agent_r1.process import free_port


@dataclass
class SGLangConfig:
    """``rollout.sglang``: what `sglang.launch_server` gets besides the model (one server per
    ``tp`` GPUs)."""

    tp: int = 1  # --tp-size: GPUs per server
    mem_fraction: float = 0.8  # --mem-fraction-static: weights + KV cache share of GPU memory
    extra_args: list[str] = field(default_factory=list)  # passed through verbatim

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"rollout.sglang.tp: must be >= 1, got {self.tp}")
        if not 0 < self.mem_fraction < 1:
            raise ValueError(f"rollout.sglang.mem_fraction: must be in (0, 1), got {self.mem_fraction}")


def sglang_command(
    model: str,
    host: str,
    port: int,
    context_length: int,
    dtype: str,
    cfg: SGLangConfig,
    api_key: str | None = None,
    python: str = sys.executable,
) -> list[str]:
    cmd = [
        python, "-m", "sglang.launch_server",
        "--model-path", model,
        "--host", host,
        "--port", str(port),
        "--context-length", str(context_length),
        "--dtype", dtype,
        "--tp-size", str(cfg.tp),
        "--mem-fraction-static", str(cfg.mem_fraction),
        "--skip-server-warmup",
    ]  # fmt: skip
    if api_key:  # SGLang takes the key on its command line only
        cmd.append(f"--api-key={api_key}")  # one token: a key may start with "-" (token_urlsafe)
    return cmd + list(cfg.extra_args)


def run_sglang(
    model: str,
    host: str,
    ready_file: Path,
    log_file: Path,
    context_length: int,
    dtype: str,
    cfg: SGLangConfig,
    ready_timeout_s: float,
    api_key: str | None = None,
    stop_when=None,
) -> int:
    """Start SGLang (its output in ``log_file``), wait until ``/health_generate`` answers, publish
    ``{"url"}`` in ``ready_file``, then wait for it; SIGTERM stops it."""
    port = free_port(host)
    server = UpstreamServer("sglang", f"http://{host}:{port}", "/health_generate", model)
    cmd = sglang_command(model, host, port, context_length, dtype, cfg, api_key)
    return server.run(cmd, dict(os.environ), ready_file, log_file, ready_timeout_s, api_key, stop_when)
