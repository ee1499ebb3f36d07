#!/usr/bin/env python
"""Benchmark: the embedded engine when the machine is shared. The uniform workload of
``rollout.py`` (requests of 128 prompt tokens -> 128 sampled, T=1, EOS ignored) in a fresh process
per run, quiet and beside one busy-loop process (one core taken): with the engine's thread
governor (what ships: ``cpus.ThreadGovernor`` picks 1 or ``--threads`` threads from step times),
at a fixed thread count (OpenMP's default policy: threads spin at barriers), and at a fixed count
under ``OMP_WAIT_POLICY=PASSIVE`` (libgomp reads it when torch loads, hence a process per run).

    python tools/bench/contention.py --model artifacts/smollm2-135m-instruct [--requests 32] [--threads 2]
                                     [--dtype auto|float32|bfloat16]

The engine runs in ``agent-r1 serve``'s default precision here (``--dtype auto``: bfloat16 on a CPU
with bf16 units, else float32).

Ends with ``BENCH rollout_uniform_<model>_neighbour tok_s=... baseline=quiet ratio=...`` (the
shipped engine beside the neighbour against its own quiet figure), the same at fixed threads and
with PASSIVE, and what the governor and PASSIVE cost on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def child(model: str, requests: int, threads: int, adapt: bool, dtype: str) -> None:
    import numpy as np
    import torch

    sys.path.insert(0, str(HERE))
    from rollout import engine_run

    from agent_r1.engines.embedded.engine import Engine

    torch.set_num_threads(threads)
    engine = Engine(model, dtype=dtype, max_running=128, max_len=512, threads=threads, adapt_threads=adapt)
    prompts = np.random.default_rng(0).integers(10, engine.vocab_size, (requests, 128)).tolist()
    engine_run(engine, prompts[:2], [4, 4], 1)  # warm-up
    dt, tok = engine_run(engine, prompts, [128] * requests, 1)
    gov = engine.governor
    print(json.dumps({"tok_s": tok / dt, "seconds": dt, "threads": gov.best if gov else threads,
                      "switches": gov.switches if gov else 0}))  # fmt: skip


def run(
    model: str, requests: int, threads: int, policy: str | None, neighbour: bool, adapt: bool, dtype: str
) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if neighbour else None
    try:
        out = subprocess.run(
            [sys.executable, __file__, "--child", "--model", model, "--requests", str(requests), "--threads", str(threads),
             "--dtype", dtype, *([] if adapt else ["--fixed"])],
            env=env, capture_output=True, text=True, check=True,
        )  # fmt: skip
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16"),
        help="auto: agent-r1 serve's default here (bfloat16 on a CPU with bf16 units, else float32)",
    )
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--fixed", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a.model, a.requests, a.threads, not a.fixed, a.dtype)
    from agent_r1.cpus import serving_dtype

    dtype = serving_dtype("cpu") if a.dtype == "auto" else a.dtype
    name = a.model.rstrip("/").split("/")[-1].replace("-135m-instruct", "").replace("-", "_")
    got = {}
    runs = (("adaptive", None, True), ("fixed", None, False), ("passive", "PASSIVE", False))
    for label, policy, adapt in runs:
        for neighbour in (False, True):
            r = run(a.model, a.requests, a.threads, policy, neighbour, adapt, dtype)
            got[label, neighbour] = r["tok_s"]
            where = "beside a busy loop" if neighbour else "quiet"
            print(
                f"{label:9s} {where:20s} {r['tok_s']:8.0f} tok/s ({r['seconds']:.1f} s; ends at {r['threads']} threads)",
                flush=True,
            )
    cpu = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name")), "?")
    print(
        f"cpu: {cpu} ({os.cpu_count()} cores); {a.requests} requests x 128 -> 128, {a.threads} threads, {dtype}"
    )
    q, b = got["adaptive", False], got["adaptive", True]
    fq, fb = got["fixed", False], got["fixed", True]
    pq, pb = got["passive", False], got["passive", True]
    print(f"BENCH rollout_uniform_{name}_neighbour tok_s={b:.0f} baseline=quiet ratio={b / q:.2f}")
    print(
        f"BENCH rollout_uniform_{name}_neighbour_fixed_threads tok_s={fb:.0f} baseline=quiet ratio={fb / fq:.2f}"
    )
    print(f"BENCH rollout_uniform_{name}_neighbour_passive tok_s={pb:.0f} baseline=quiet ratio={pb / fq:.2f}")
    print(
        f"BENCH rollout_uniform_{name}_quiet_adaptive tok_s={q:.0f} baseline=fixed_threads ratio={q / fq:.2f}"
    )
    print(
        f"BENCH rollout_uniform_{name}_quiet_passive tok_s={pq:.0f} baseline=fixed_threads ratio={pq / fq:.2f}"
    )


if __name__ == "__main__":
    main()
