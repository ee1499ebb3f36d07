"""The real ``sglang-router`` in front of a run's rollout servers.

The router starts with no workers; every server registers itself once it serves (``POST
/workers``, as slime's engines do), so a restarted server (new address) joins by itself and the
router's health checks retire the dead one. Rollout workers send ``/generate`` to the router;
weight pushes and version checks still go to each server directly.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

from agent_r1.http_service import http_request, write_ready
from agent_r1.process import die_with_parent, free_port, wait_or_stop

log = logging.getLogger("agent_r1.router")


def router_command(
    host: str, port: int, policy: str, api_key: str | None, python: str = sys.executable
) -> list[str]:
    cmd = [
        python, "-m", "sglang_router.launch_router",
        "--host", host, "--port", str(port),
        "--policy", policy,
        "--log-level", "warn",
        "--prometheus-host", host, "--prometheus-port", str(free_port(host)),
    ]  # fmt: skip
    if api_key:  # what the router sends to the workers, which require it
        cmd.append(f"--api-key={api_key}")  # one token: a key may start with "-" (token_urlsafe)
    return cmd


def run_router(
    host: str,
    ready_file: Path,
    log_file: Path,
    policy: str,
    api_key: str | None,
    ready_timeout_s: float,
    stop_when=None,
) -> int:
    """Start the router (its output in ``log_file``), publish ``{"url"}`` once it answers, wait."""
    port = free_port(host)
    with log_file.open("ab") as out:
        proc = subprocess.Popen(
            router_command(host, port, policy, api_key),
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent(),  # the router does not outlive its role
        )
    signal.signal(signal.SIGTERM, lambda *_: proc.terminate())
    url = f"http://{host}:{port}"
    deadline = time.time() + ready_timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"sglang-router exited with {proc.returncode}: see {log_file}")
        try:
            if http_request("GET", url + "/workers", timeout=2, api_key=api_key)[0] == 200:
                break
        except OSError:
            pass
        if time.time() > deadline:
            proc.kill()
            raise TimeoutError(
                f"sglang-router at {url} did not answer within {ready_timeout_s:.0f} s: see {log_file}"
            )
        time.sleep(0.2)
    write_ready(ready_file, url)
    log.info("sglang-router (%s) at %s", policy, url)
    return wait_or_stop(proc, stop_when)


def register(router: str, server: str, api_key: str | None = None, timeout_s: float = 60.0) -> None:
    """Add ``server`` to the router (``POST /workers``) and wait until the router lists it. The
    worker's key goes in the body (the router's ``WorkerConfigRequest.api_key``): the router's
    health probes and requests to a keyed worker carry it."""
    body = {"url": server, "worker_type": "regular"}
    if api_key:
        body["api_key"] = api_key
    status, text = http_request("POST", router + "/workers", body, api_key=api_key)
    if status >= 300:
        raise RuntimeError(f"router {router} refused worker {server}: {status} {text[:300]}")
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        status, text = http_request("GET", router + "/workers", api_key=api_key)
        if status == 200 and any(w.get("url") == server for w in json.loads(text).get("workers", [])):
            log.info("registered with the router %s", router)
            return
        time.sleep(0.2)
    raise TimeoutError(f"router {router} did not list {server} within {timeout_s:.0f} s")
