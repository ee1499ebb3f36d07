"""Real SGLang servers (GPU nodes): the launch command from the run's config, start-up with a
bounded wait on ``/health_generate``, then the same published address file as the embedded server,
so clients, workers and the coordinator cannot tell them apart."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from agent_r1.process import die_with_parent, wait_or_stop
from agent_r1.service import write_ready

log = logging.getLogger("agent_r1.sglang")


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
        cmd += ["--api-key", api_key]
    return cmd + list(cfg.extra_args)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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
    port = _free_port(host)
    cmd = sglang_command(model, host, port, context_length, dtype, cfg, api_key)
    with log_file.open("ab") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ}, preexec_fn=die_with_parent()
        )
    signal.signal(signal.SIGTERM, lambda *_: proc.terminate())
    url = f"http://{host}:{port}"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.time() + ready_timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(
                f"sglang.launch_server exited with {proc.returncode} before it was ready: see {log_file}"
            )
        try:
            with urllib.request.urlopen(
                urllib.request.Request(f"{url}/health_generate", headers=headers), timeout=30
            ) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if time.time() > deadline:
            proc.kill()
            raise TimeoutError(f"SGLang at {url} not healthy within {ready_timeout_s:.0f} s: see {log_file}")
        time.sleep(2)
    write_ready(ready_file, url, model=model, engine="sglang")
    log.info("SGLang serving %s at %s (log %s)", model, url, log_file)
    return wait_or_stop(proc, stop_when)
