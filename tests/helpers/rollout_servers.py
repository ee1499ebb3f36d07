"""Start real ``agent-r1 serve`` processes (and the real sglang-router) on loopback for tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from agent_r1.process import free_port


def http(method: str, url: str, body: object | None = None, timeout: float = 30) -> tuple[int, object]:
    """(status, parsed JSON or text); HTTP errors are returned, not raised."""
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read().decode()
    try:
        return status, json.loads(raw) if raw else None
    except json.JSONDecodeError:
        return status, raw


class ServerProc:
    def __init__(self, model: Path, run_dir: Path, name: str, *extra: str):
        ready = run_dir / "control" / "servers" / f"{name}.json"
        self.log = open(run_dir / f"{name}.log", "w")  # noqa: SIM115
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "agent_r1.cli",
                "serve",
                "--model",
                str(model),
                "--port",
                "0",
                "--threads",
                "1",
                "--dtype",
                "float32",  # the tests compare with HF in float32 (auto is bf16 on CPUs with bf16 units)
                "--max-running",
                "16",
                "--max-len",
                "1024",
                "--ready-file",
                str(ready),
                *extra,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        deadline = time.time() + 120
        while not ready.exists():
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(
                    f"server {name} did not start: {(run_dir / f'{name}.log').read_text()[-2000:]}"
                )
            time.sleep(0.1)
        self.url = json.loads(ready.read_text())["url"]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.log.close()


class RouterProc:
    def __init__(self, run_dir: Path, policy: str = "round_robin"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(run_dir / "router.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sglang_router.launch_router",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--policy",
                policy,
                "--log-level",
                "warn",
                "--prometheus-host",
                "127.0.0.1",
                "--prometheus-port",
                str(free_port()),
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.time() + 60
        while True:
            try:
                http("GET", self.url + "/workers", timeout=1)
                break
            except (urllib.error.URLError, ConnectionError):
                if self.proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(
                        "router did not start: " + (run_dir / "router.log").read_text()[-2000:]
                    ) from None
                time.sleep(0.2)

    def register(self, url: str, timeout: float = 30) -> None:
        """Register a worker the way slime does (POST /workers) and wait until it is healthy."""
        status, answer = http("POST", self.url + "/workers", {"url": url, "worker_type": "regular"})
        if status >= 300:
            raise RuntimeError(f"router refused worker {url}: {status} {answer}")
        deadline = time.time() + timeout
        while time.time() < deadline:
            ws = http("GET", self.url + "/workers")[1]["workers"]
            if any(w["url"] == url and w.get("is_healthy", True) for w in ws):
                return
            time.sleep(0.2)
        raise RuntimeError(f"worker {url} never became healthy in the router")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()
