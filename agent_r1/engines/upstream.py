"""An upstream inference server as a run's role (SGLang, vLLM): start its process (output in the
role's log), wait with a bound until its health route answers, publish its address in the same
ready file the embedded server writes (so clients, workers and the coordinator find it the same
way), then wait for it; SIGTERM or the run's stop flag stops it."""

from __future__ import annotations

import logging
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from agent_r1.http_service import write_ready
from agent_r1.process import die_with_parent, wait_or_stop

log = logging.getLogger("agent_r1.upstream")


@dataclass(frozen=True)
class UpstreamServer:
    engine: str  # sglang | vllm: written in the ready file
    url: str
    health_path: str
    model: str

    def healthy(self, api_key: str | None) -> bool:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        try:
            req = urllib.request.Request(self.url + self.health_path, headers=headers)
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status == 200
        except OSError:
            return False

    def run(
        self,
        cmd: list[str],
        env: dict[str, str],
        ready_file: Path,
        log_file: Path,
        ready_timeout_s: float,
        api_key: str | None = None,
        stop_when=None,
    ) -> int:
        with log_file.open("ab") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=die_with_parent()
            )
        signal.signal(signal.SIGTERM, lambda *_: proc.terminate())
        deadline = time.time() + ready_timeout_s
        while not self.healthy(api_key):
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{self.engine} server exited with {proc.returncode} before it was ready: see {log_file}"
                )
            if time.time() > deadline:
                proc.kill()
                raise TimeoutError(
                    f"{self.engine} server at {self.url} not healthy within {ready_timeout_s:.0f} s: see {log_file}"
                )
            time.sleep(2)
        write_ready(ready_file, self.url, model=self.model, engine=self.engine)
        log.info("%s serving %s at %s (log %s)", self.engine, self.model, self.url, log_file)
        return wait_or_stop(proc, stop_when)
