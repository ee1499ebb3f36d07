#!/usr/bin/env python
"""Benchmark: what ``trainer.deterministic`` costs the rollout engine and the learner. The embedded engine with
``batch_invariant=True`` (every linear layer through the batch-invariant kernel, no cascade
attention, a fixed thread count) against the same engine as runs use it by default, in the same
run, on the agentic workload of ``rollout.py``: 16 prompts of 256 tokens x n=8 samples, per-request
max_new_tokens drawn in [16, 192], temperature 1, each request seeded.

    python tools/bench/deterministic.py --model artifacts/tiny-qwen3 [--model artifacts/smollm2-135m-instruct]

Also checks what the mode promises on this workload: the invariant engine's tokens and logprobs
are the same bits on every repeat, with the requests submitted in another order each time.

The learner: one iteration's work on a quickstart-shaped batch (16 groups of 8 two-step episodes,
prompts of 150-200 tokens, actions of 10-40), one PPO step (its forward gives the old logprobs), with the
engine's ``Scorer`` as the source of the logprob values (deterministic mode: true on-policy)
against the learner as runs use it by default, the same thread count. Ends with ``BENCH`` lines
(generated tokens/s, seconds per iteration; ratio = default time / deterministic time).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch


def run(engine, prompts: list[list[int]], max_news: list[int], order: list[int]) -> tuple[float, dict]:
    """Every group submitted at once in ``order``; (seconds, (group, sample) -> (tokens, logprobs))."""
    reqs = {}
    for g in order:
        rs = engine.make_requests(
            prompts[g],
            {"temperature": 1.0, "max_new_tokens": 192, "ignore_eos": True, "n": 8, "sampling_seed": 7 * g},
            return_logprob=True,
        )
        for k, r in enumerate(rs):  # per-request budgets within a group
            r.sampling = type(r.sampling)(**{**r.sampling.__dict__, "max_new_tokens": max_news[8 * g + k]})
            reqs[g, k] = r
    engine.cache.clear()
    t0 = time.perf_counter()
    engine.waiting.extend(reqs.values())
    engine.run_until_idle()  # the scheduler loop, in this (main) thread
    dt = time.perf_counter() - t0
    return dt, {key: (tuple(r.out_ids), tuple(r.out_logprobs)) for key, r in reqs.items()}


def bench_model(path: str, threads: int, repeat: int, lines: list[str]) -> None:
    from agent_r1.engines.embedded.engine import Engine

    name = path.rstrip("/").split("/")[-1]
    rng = np.random.default_rng(0)
    engines = {
        mode: Engine(path, max_running=128, max_len=512, threads=threads, batch_invariant=mode == "invariant")
        for mode in ("default", "invariant")
    }
    vocab = engines["default"].vocab_size
    prompts = rng.integers(10, vocab, (16, 256)).tolist()
    max_news = rng.integers(16, 193, 16 * 8).tolist()
    orders = [rng.permutation(16).tolist() for _ in range(repeat)]
    best, outs = {}, {}
    for mode, engine in engines.items():
        run(engine, prompts[:2], [8] * 16, [0, 1])  # warm-up
        times = []
        for order in orders:
            dt, out = run(engine, prompts, max_news, order)
            times.append(dt)
            outs.setdefault(mode, []).append(out)
        best[mode] = min(times)
    tokens = sum(max_news)
    same = all(o == outs["invariant"][0] for o in outs["invariant"][1:])
    differ = sum(
        a != b
        for o in outs["default"][1:]
        for a, b in zip(o.values(), outs["default"][0].values(), strict=True)
    )
    packed = sum(L.packed is not None for layer in engines["default"].sm.layers for L in (layer.qkv, layer.o))
    print(
        f"[{name}] default engine {tokens / best['default']:.0f} tok/s ({packed} of "
        f"{2 * len(engines['default'].sm.layers)} attention projections prepacked), batch-invariant "
        f"{tokens / best['invariant']:.0f} tok/s; invariant repeats bitwise equal: {same}; default "
        f"repeats: {differ} of {len(max_news) * (repeat - 1)} samples differ in some bit"
    )
    if not same:
        raise SystemExit(f"[{name}] the batch-invariant engine gave different bits across repeats")
    lines.append(
        f"BENCH deterministic_engine_{name} tokens_per_s={tokens / best['invariant']:.0f} "
        f"baseline=default_engine ratio={best['default'] / best['invariant']:.2f}"
    )


def bench_learner(path: str, lines: list[str]) -> None:
    import socket

    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from transformers import AutoConfig

    from agent_r1.engines.embedded.scorer import Scorer
    from agent_r1.learner.actor import Actor
    from agent_r1.learner.actor_steps import PolicyTargets
    from agent_r1.learner.backend.cpu_compat import apply
    from agent_r1.learner.batch import LearnerBatch
    from agent_r1.learner.optim import OptimConfig
    from agent_r1.records.synth import synth_table
    from megatron_bridge import BridgeConfig

    name = path.rstrip("/").split("/")[-1]
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        apply()
        ps.initialize_model_parallel(1, 1)
    vocab = AutoConfig.from_pretrained(path).vocab_size
    table = synth_table(128, group_size=8, max_steps=2, seed=0, prompt_len=(150, 200),
                        action_len=(10, 40), feedback_len=(5, 10), vocab=vocab)  # fmt: skip
    batch = LearnerBatch.from_table(table)
    micro = batch.micro_batches(None, 4096)
    adv = batch.per_token(torch.linspace(-1, 1, batch.num_steps))
    optim = OptimConfig(lr=1e-5, micro_tokens=4096)
    best = {}
    for mode in ("default", "deterministic"):
        values = Scorer(path, "float32", 1.0) if mode == "deterministic" else None
        actor = Actor(path, BridgeConfig(), optim, adapt_threads=False, logprob_values=values)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            actor.train_step(micro, PolicyTargets(adv), "ppo")  # one step: its forward gives the old logprobs
            times.append(time.perf_counter() - t0)
        best[mode] = min(times)
    print(
        f"[{name}] learner iteration ({batch.num_action_tokens} action tokens, {len(micro)} micro-batches): "
        f"default {best['default']:.2f} s, with the engine's logprobs {best['deterministic']:.2f} s"
    )
    lines.append(
        f"BENCH deterministic_learner_{name} seconds_per_iteration={best['deterministic']:.2f} "
        f"baseline=default_learner ratio={best['default'] / best['deterministic']:.2f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", required=True, help="HF model folder (repeatable)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    lines: list[str] = []
    for m in a.model:
        bench_model(m, a.threads, a.repeat, lines)
    for m in a.model:
        bench_learner(m, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
