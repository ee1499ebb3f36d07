#!/usr/bin/env python
"""Mixture-of-experts learner benchmark: the same PPO optimizer steps of a Qwen3-MoE on the same
tokens over two gloo ranks (DP 2), the experts spread over both ranks (EP 2: each rank holds half
of them and the alltoall dispatcher sends each token to its experts' rank) against every rank
holding every expert (EP 1, the baseline). Seconds per optimizer step, best of ``--repeat``, and
the weights each rank holds; the machine's CPU is named in the output. On CPU the experts' total
work is the same either way and gloo's alltoall is extra: EP buys memory (each rank's experts,
their gradients and optimizer state), which is what lets a large MoE fit its GPUs.

    python tools/bench/moe.py [--experts 16] [--hidden 256] [--layers 4] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def build(out: Path, a: argparse.Namespace) -> Path:
    import transformers as tf

    cfg = tf.Qwen3MoeConfig(
        vocab_size=2048, hidden_size=a.hidden, intermediate_size=3 * a.hidden, moe_intermediate_size=a.hidden,
        num_hidden_layers=a.layers, num_attention_heads=4, num_key_value_heads=2, head_dim=a.hidden // 4,
        num_experts=a.experts, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=2048,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out)
    return out


def worker(rank: int, port: str, model: str, ep: int, repeat: int, out: str) -> None:
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from megatron.core import parallel_state as ps

    from agent_r1.learner.actor import Actor
    from agent_r1.learner.actor_steps import PolicyTargets
    from agent_r1.learner.backend.cpu_compat import apply
    from agent_r1.learner.batch import LearnerBatch
    from agent_r1.learner.optim import OptimConfig
    from agent_r1.records.synth import synth_table
    from megatron_bridge import BridgeConfig

    apply()
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=ep, expert_tensor_parallel_size=1)
    table = synth_table(32, group_size=4, max_steps=3, seed=rank, prompt_len=(60, 120),
                        action_len=(16, 48), feedback_len=(8, 32), vocab=2048)  # fmt: skip
    batch = LearnerBatch.from_table(table)
    micro = batch.micro_batches(None, 2048)
    count = torch.tensor([len(micro)])  # as many micro-batches on both ranks (the learner does so)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    micro = batch.micro_batches(None, 2048, count=int(count))
    adv = batch.per_token(torch.ones(batch.num_steps))
    actor = Actor(model, BridgeConfig(ep=ep), OptimConfig(lr=1e-5, micro_tokens=2048))
    targets = PolicyTargets(adv, actor.logprobs(micro, batch.num_action_tokens))
    actor.train_step(micro, targets, "ppo")  # warm-up
    times = []
    for _ in range(repeat):
        dist.barrier()
        t0 = time.perf_counter()
        actor.train_step(micro, targets, "ppo")
        dist.barrier()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        params = sum(p.numel() * p.element_size() for p in actor.module.parameters())
        Path(out).write_text(
            json.dumps(
                {
                    "seconds": min(times),
                    "tokens": int(batch.num_stream_tokens) * 2,
                    "params_mb": params / 2**20,
                }
            )
        )


def run(model: Path, ep: int, repeat: int, tmp: Path) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    out = tmp / f"ep{ep}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", str(r), port, str(model), str(ep), str(repeat), str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for r in range(2)
    ]
    logs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        sys.exit("\n".join(log[-3000:] for log in logs))
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        rank, port, model, ep, repeat, out = a.worker
        worker(int(rank), port, model, int(ep), int(repeat), out)
        return
    cpu = next(
        (x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name")),
        platform.processor(),
    )
    print(
        f"cpu: {cpu}, {os.cpu_count()} cores; {a.experts} experts top 2, hidden {a.hidden}, {a.layers} layers"
    )
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = build(tmp / "moe", a)
        base, ep2 = run(model, 1, a.repeat, tmp), run(model, 2, a.repeat, tmp)
    for name, r in (("ep1", base), ("ep2", ep2)):
        print(
            f"{name}: {r['seconds']:.3f} s per optimizer step, {r['tokens']} tokens over 2 ranks, "
            f"{r['params_mb']:.1f} MB of weights per rank"
        )
    ratio = base["seconds"] / ep2["seconds"]
    print(f"BENCH moe_update_ep2 seconds={ep2['seconds']:.3f} baseline=ep1 ratio={ratio:.3f}")
    mem = base["params_mb"] / ep2["params_mb"]
    print(f"BENCH moe_update_ep2_weights_per_rank mb={ep2['params_mb']:.1f} baseline=ep1 ratio={mem:.3f}")


if __name__ == "__main__":
    main()
