#!/usr/bin/env python
"""Benchmark: generated tokens/s of the embedded engine vs ``transformers`` ``generate`` on the same
model and inputs, in the same run.

  (a) uniform: 64 requests, prompt 128, output 128, temperature 1;
  (b) agentic: 16 prompts of 256 tokens x n=8 samples, per-request max_new_tokens drawn in
      [16, 192], temperature 1 -- the baseline expands each prompt 8x into one batch and runs it
      to its longest member (counting only the requested tokens as useful).

    python tools/bench/rollout.py --model artifacts/tiny-qwen3 [--model artifacts/smollm2-135m-instruct]

Both sides use the same torch thread count. Ends with ``BENCH`` lines and peak RSS.
"""

from __future__ import annotations

import argparse
import resource
import time

import numpy as np
import torch


def rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


def hf_generate(model, prompts: list[list[int]], max_new: int) -> float:
    """One batch (all prompts the same length: no padding), sampled, EOS ignored."""
    ids = torch.tensor(prompts)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            pad_token_id=0,
        )
    assert out.shape[1] == ids.shape[1] + max_new
    return time.perf_counter() - t0


def engine_run(engine, prompts: list[list[int]], max_news: list[int], n: int) -> tuple[float, int]:
    reqs = []
    for p, m in zip(prompts, max_news[::n] if n > 1 else max_news, strict=False):
        reqs += engine.make_requests(p, {"temperature": 1.0, "max_new_tokens": m, "ignore_eos": True, "n": n})
    if n > 1:  # per-request budgets within a group
        for r, m in zip(reqs, max_news, strict=True):
            r.sampling = type(r.sampling)(**{**r.sampling.__dict__, "max_new_tokens": m})
    t0 = time.perf_counter()
    engine.waiting.extend(reqs)
    engine.run_until_idle()  # the scheduler loop, in this (main) thread
    dt = time.perf_counter() - t0
    tokens = sum(len(r.out_ids) for r in reqs)
    assert tokens == sum(max_news), (tokens, sum(max_news))
    return dt, tokens


def bench_model(path: str, threads: int, agentic: bool, lines: list[str]) -> None:
    from transformers import AutoModelForCausalLM

    from agent_r1.engines.embedded.engine import Engine

    name = path.rstrip("/").split("/")[-1]
    rng = np.random.default_rng(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    vocab = model.config.vocab_size

    # (a) uniform; runs shorter than a few seconds are repeated (best of 5 or 3, both sides) against
    # timer noise
    prompts = rng.integers(10, vocab, (64, 128)).tolist()
    t_hf = hf_generate(model, prompts, 128)
    repeat = 5 if t_hf < 2 else 3 if t_hf < 5 else 1
    t_hf = min([t_hf] + [hf_generate(model, prompts, 128) for _ in range(repeat - 1)])
    engine = Engine(path, max_running=128, max_len=512)
    packed = sum(
        L.packed is not None
        for layer in engine.sm.layers
        for L in (layer.qkv, layer.o, layer.gate_up, layer.down)
    )
    print(f"[{name}] linear layers prepacked for oneDNN: {packed} of {4 * len(engine.sm.layers)}")
    try:
        engine_run(engine, prompts[:4], [8] * 4, 1)  # warm-up
        t_en, tok = min(engine_run(engine, prompts, [128] * 64, 1) for _ in range(repeat))
        print(
            f"[{name}] uniform: engine {tok / t_en:.0f} tok/s ({t_en:.1f} s), transformers {tok / t_hf:.0f} tok/s ({t_hf:.1f} s)"
        )
        lines.append(
            f"BENCH rollout_uniform_{name} tokens_per_s={tok / t_en:.0f} baseline=transformers_generate ratio={t_hf / t_en:.2f}"
        )
        if agentic:
            prompts = rng.integers(10, vocab, (16, 256)).tolist()
            max_news = rng.integers(16, 193, 16 * 8).tolist()
            expanded = [p for p in prompts for _ in range(8)]
            t_hf = min(hf_generate(model, expanded, max(max_news)) for _ in range(repeat))
            runs = []
            for _ in range(repeat):
                engine.cache.clear()
                runs.append(engine_run(engine, prompts, max_news, 8))
            t_en, tok = min(runs)
            print(
                f"[{name}] agentic: engine {tok / t_en:.0f} tok/s ({t_en:.1f} s), transformers {tok / t_hf:.0f} useful tok/s ({t_hf:.1f} s)"
            )
            lines.append(
                f"BENCH rollout_agentic_{name} tokens_per_s={tok / t_en:.0f} baseline=transformers_generate ratio={t_hf / t_en:.2f}"
            )
    finally:
        del engine
    print(f"[{name}] peak RSS {rss_gb():.2f} GB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", required=True, help="HF model folder (repeatable)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-agentic", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    lines: list[str] = []
    for m in a.model:
        bench_model(m, a.threads, not a.no_agentic, lines)
    print(f"peak RSS {rss_gb():.2f} GB")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
