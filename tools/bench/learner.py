#!/usr/bin/env python
"""Benchmark: training a batch of 5-step append-mode trajectories as prefix-merged packed
sequences vs the per-step padded rows Agent-R1 and verl use (one row per step, each re-prefilling
its whole observation). Same Megatron-Core model, same loss (mean action-token logprob),
forward + backward, in one run.

    python tools/bench/learner.py [--trajectories 16 --steps 5 --hidden 256 --layers 4]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trajectories", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--micro-tokens", type=int, default=1024, help="packed tokens per micro-batch")
    ap.add_argument("--no-tp2", action="store_true", help="skip the TP2-vs-TP1 step time")
    ap.add_argument("--tp2-worker", nargs=4, metavar=("RANK", "PORT", "OUT", "MODEL"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.tp2_worker:
        return tp2_worker(a)
    torch.set_num_threads(a.threads)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)

    from agent_r1.learner.packing import pack, pack_micro_batches, per_step_rows
    from agent_r1.learner.policy import packed_forward, packed_logprobs
    from agent_r1.models.tiny import build_tiny_model

    d = build_tiny_model(
        tempfile.mkdtemp() + "/m",
        [f"w{i} " * 3 for i in range(3000)],
        arch="qwen3",
        vocab_size=a.vocab,
        hidden=a.hidden,
        layers=a.layers,
        heads=4,
        kv_heads=2,
    )
    model, cfg, trajs = _setup(a, 1, str(d))
    steps = sum(len(x) for x in trajs)
    packed = pack(trajs)
    micro = pack_micro_batches(trajs, a.micro_tokens)
    n_labels = int(packed.label_pos.numel())
    rows, lengths = per_step_rows(trajs)

    def merged_step() -> float:
        model.zero_grad(set_to_none=True)
        total = 0.0
        for _, mb in micro:  # gradient accumulation over packed micro-batches
            lp, _ = packed_logprobs(packed_forward(model, mb), mb, vocab_size=cfg.vocab_size)
            loss = -lp.sum() / n_labels
            loss.backward()
            total += float(loss.detach())
        return total

    def padded_step() -> float:
        model.zero_grad(set_to_none=True)
        B, S = rows.shape
        logits = model(rows, torch.arange(S).expand(B, S), None)  # causal; padding sits after each row
        logp = torch.log_softmax(logits[:, :-1, : cfg.vocab_size].float(), -1).gather(-1, rows[:, 1:, None])[
            ..., 0
        ]
        mask = torch.zeros(B, S - 1, dtype=torch.bool)
        i = 0
        for steps_ in trajs:
            for s in steps_:
                mask[i, len(s["obs"]) - 1 : len(s["obs"]) + len(s["action"]) - 1] = True
                i += 1
        loss = -(logp * mask).sum() / mask.sum()
        loss.backward()
        return float(loss.detach())

    def best(fn):
        fn()  # warm-up
        ts = []
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            val = fn()
            ts.append(time.perf_counter() - t0)
        return min(ts), val

    t_m, l_m = best(merged_step)
    t_p, l_p = best(padded_step)
    tok_m, tok_p, tok_unpadded = packed.num_tokens, rows.numel(), int(lengths.sum())
    print(
        f"{len(trajs)} trajectories, {steps} steps, {len(micro)} packed micro-batches; loss merged {l_m:.6f} vs per-step {l_p:.6f} (same objective)"
    )
    print(f"tokens: merged packed {tok_m}, per-step rows {tok_unpadded} unpadded / {tok_p} padded")
    print(f"time: merged {t_m:.3f} s, per-step padded {t_p:.3f} s")
    assert abs(l_m - l_p) < 1e-4, "the two layouts must compute the same loss"
    print(
        f"BENCH learner_prefix_merge_tokens tokens={tok_m} baseline=per_step_padded_rows ratio={tok_p / tok_m:.2f}"
    )
    print(
        f"BENCH learner_prefix_merge_time seconds={t_m:.3f} baseline=per_step_padded_rows ratio={t_p / t_m:.2f}"
    )
    dist.destroy_process_group()
    if not a.no_tp2:
        # the same merged step at TP2: two processes with one thread each (the TP1 run had 2 threads)
        import json
        import socket
        import subprocess
        import sys

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = str(sock.getsockname()[1])
        out = tempfile.mktemp(suffix=".json")
        args = [
            f"--trajectories={a.trajectories}",
            f"--steps={a.steps}",
            f"--hidden={a.hidden}",
            f"--layers={a.layers}",
            f"--vocab={a.vocab}",
            f"--repeat={a.repeat}",
            f"--micro-tokens={a.micro_tokens}",
        ]
        procs = [
            subprocess.Popen([sys.executable, __file__, *args, "--tp2-worker", str(r), port, out, str(d)])
            for r in range(2)
        ]
        assert all(p.wait() == 0 for p in procs)
        with open(out) as f:
            t_tp2 = json.load(f)["seconds"]
        print(
            f"time: merged step TP1 (1 process x 2 threads) {t_m:.3f} s, TP2 (2 processes x 1 thread) {t_tp2:.3f} s"
        )
        print(f"BENCH learner_tp2_step seconds={t_tp2:.3f} baseline=tp1_2threads ratio={t_m / t_tp2:.2f}")


def _setup(a, tp: int, d: str):
    """The TP1 run's model (HF folder ``d``) at ``tp`` and the benchmark trajectories."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from agent_r1.learner.cpu_compat import apply
    from agent_r1.learner.packing import trajectories_from_records
    from agent_r1.records.schema import records_from_table
    from agent_r1.records.synth import synth_table
    from megatron_bridge import BridgeConfig, build_gpt_model, load_hf_weights

    apply()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(0)
    cfg = AutoConfig.from_pretrained(d)
    model = build_gpt_model(cfg, BridgeConfig(tp=tp))
    load_hf_weights(model, load_file(f"{d}/model.safetensors"), cfg)
    t = synth_table(
        a.trajectories,
        group_size=4,
        max_steps=a.steps,
        seed=0,
        prompt_len=(96, 160),
        action_len=(24, 64),
        feedback_len=(16, 48),
        vocab=cfg.vocab_size,
    )
    return model, cfg, trajectories_from_records(records_from_table(t))


def tp2_worker(a) -> None:
    import json

    rank, port, out, model_dir = int(a.tp2_worker[0]), a.tp2_worker[1], a.tp2_worker[2], a.tp2_worker[3]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from megatron.core import parallel_state as ps

    from agent_r1.learner.packing import pack, pack_micro_batches
    from agent_r1.learner.policy import packed_forward, packed_logprobs

    model, cfg, trajs = _setup(a, 2, model_dir)
    micro = pack_micro_batches(trajs, a.micro_tokens)
    n_labels = int(pack(trajs).label_pos.numel())
    group = ps.get_tensor_model_parallel_group()

    def step() -> None:
        model.zero_grad(set_to_none=True)
        for _, mb in micro:
            logits = packed_forward(model, mb)
            lp, _ = packed_logprobs(logits, mb, group, rank * logits.shape[-1], cfg.vocab_size)
            (-lp.sum() / n_labels).backward()

    step()
    ts = []
    for _ in range(a.repeat):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        dist.barrier()
        ts.append(time.perf_counter() - t0)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"seconds": min(ts)}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
