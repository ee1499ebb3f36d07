#!/usr/bin/env python
"""Learner benchmarks, each against a named baseline in the same run.

1. ``update`` (default): the update phase of one RL iteration -- old logprobs, advantages and every
   mini-batch step -- through ``Learner.update`` (one columnar ``LearnerBatch``, prefix-merged
   sequences, Megatron-Core) against the plain HF/TRL-style step on the same records
   (``hf_padded``: one right-padded row per trajectory, logits at every position, the clip loss on
   the action tokens, AdamW, clip 1.0), in the same precision; at quickstart size (the tiny Qwen3)
   and at SmolLM2-135M size (random weights, its exact shape). On a CPU with bf16 units
   (AVX512_BF16 or AMX) the same update again in bf16 mixed precision (``model.dtype=bfloat16``:
   fp32 main weights, optimizer and loss) against its float32 time. ``--baseline COMMIT`` compares
   against this package at a commit instead (``git archive``), ``--baseline list`` against the
   frozen list path of ``tests/learner/list_path.py``. Each path runs in its own process, so its
   peak RSS is its own; the paths take turns, one timed update each per round (``--repeat``
   rounds, the best kept), so a slow spell of a shared machine falls on all of them alike.
2. ``share``: the same update with shared prefixes (``optim.share_prefix=16``: a group's
   trajectories share their prompt's rows) against itself without, at the SmolLM2 GRPO preset's
   shape (``smollm2_grpo``: 4 groups of 8 one-step episodes, ~190-token prompts, 12-28-token
   answers) and at the quickstart's.
3. ``merge``: training 5-step append-mode trajectories as prefix-merged packed sequences against the
   per-step padded rows Agent-R1 and verl use (one row per step, each re-prefilling its whole
   observation); same Megatron-Core model, same loss; plus the merged step at TP2.

    python tools/bench/learner.py [--only update|share|merge] [--sizes quickstart,smollm2] [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]

# (model shape, records) per size; the records: groups of multi-step append-mode trajectories
SIZES = {
    "quickstart": dict(
        model=dict(arch="qwen3", vocab=1024, hidden=64, layers=2, heads=4, kv_heads=2, ffn=192),
        records=dict(
            trajectories=128,
            group_size=8,
            max_steps=3,
            prompt_len=(60, 120),
            action_len=(8, 48),
            feedback_len=(8, 32),
        ),  # fmt: skip
        micro_tokens=4096,
    ),
    # the SmolLM2 GRPO preset's shape (smollm2_arithmetic_grpo): one step, a ~190-token prompt
    # (system prompt, worked example, question) shared by the 8 samples of a group, short answers
    "smollm2_grpo": dict(
        model=dict(arch="llama", vocab=49152, hidden=576, layers=30, heads=9, kv_heads=3, ffn=1536),
        records=dict(
            trajectories=32,
            group_size=8,
            max_steps=1,
            prompt_len=(180, 200),
            action_len=(12, 28),
            feedback_len=(8, 32),
        ),  # fmt: skip
        micro_tokens=2048,
    ),
    "smollm2": dict(
        model=dict(arch="llama", vocab=49152, hidden=576, layers=30, heads=9, kv_heads=3, ffn=1536),
        records=dict(
            trajectories=8,
            group_size=4,
            max_steps=4,
            prompt_len=(60, 120),
            action_len=(16, 48),
            feedback_len=(8, 32),
        ),  # fmt: skip
        micro_tokens=4096,
    ),
}


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _init(threads: int) -> None:
    torch.set_num_threads(threads)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ.setdefault("MASTER_PORT", _free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)


def build_model(out: Path, shape: dict) -> Path:
    """A random HF model of the given shape (with a tiny tokenizer-free folder: the learner only
    reads config.json and the safetensors)."""
    import transformers as tf

    cls = {"qwen3": tf.Qwen3Config, "llama": tf.LlamaConfig}[shape["arch"]]
    cfg = cls(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["ffn"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"], head_dim=shape["hidden"] // shape["heads"],
        max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out)
    return out


# ---- 1. the update phase ----------------------------------------------------------------------------
def update_worker(a: argparse.Namespace) -> None:
    """One path, one size, driven by the parent (``_serve``)."""
    path, size, model_dir = a.update_worker
    _init(a.threads)
    from megatron.core import parallel_state as ps

    from agent_r1.learner.backend.cpu_compat import apply
    from agent_r1.records.synth import synth_table
    from agent_r1.train.config import load_config
    from agent_r1.train.learner_rank import Learner

    apply()
    ps.initialize_model_parallel(1, 1)
    spec = SIZES[size]
    cfg = load_config(
        [f"model.path={model_dir}", "model.build=null", "trainer.progress=false",
         f"optim.micro_tokens={spec['micro_tokens']}", *a.overrides]
    )  # fmt: skip
    learner = Learner(cfg)
    table = synth_table(seed=0, vocab=spec["model"]["vocab"], **spec["records"])
    if path == "list":  # the frozen list path on today's model code
        sys.path.insert(0, str(ROOT / "tests" / "learner"))
        import list_path

        run = list_path.update
    else:
        run = Learner.update

    def update(it: int) -> dict:
        m = run(learner, table, 1, it)
        return {"tokens": m["train/tokens"], "loss": m["loss/pg"]}

    _serve(update)


def _serve(update) -> None:
    """A worker's side of the interleaving: one warm-up update, then one timed update for each line
    the parent writes to stdin, each answered with {"seconds"} (meanwhile the parent's other
    workers wait on their stdin, taking no CPU); at EOF {"seconds": the best, "rss_mb": peak RSS,
    and the last update's "tokens" and "loss"}."""
    last = update(0)
    print(json.dumps({"ready": True}), flush=True)
    times = []
    for it, _ in enumerate(sys.stdin, 1):
        t0 = time.perf_counter()
        last = update(it)
        times.append(time.perf_counter() - t0)
        print(json.dumps({"seconds": times[-1]}), flush=True)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"seconds": min(times), "rss_mb": rss, **last}), flush=True)


def _baseline_tree(commit: str, tmp: Path) -> Path:
    """The package at ``commit`` (git archive of this repository) in ``tmp``."""
    out = tmp / f"baseline_{commit}"
    out.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", commit, "agent_r1", "megatron_bridge", "recipes", "configs"],
        capture_output=True, check=False,
    )  # fmt: skip
    if archive.returncode:
        sys.exit(f"--baseline {commit}: git archive failed ({archive.stderr.decode().strip()}); "
                 "use a clone with history or --baseline list")  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive.stdout, check=True)
    return out


class _Worker:
    """One path in its own process (``_serve``), started and warmed up before the next one starts,
    then driven one timed update at a time."""

    def __init__(self, args: list[str], env: dict[str, str], what: str):
        self.what, self.err = what, tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            [sys.executable, __file__, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.err, text=True, env=env,
        )  # fmt: skip
        self._expect("ready")

    def _expect(self, key: str) -> dict:
        seen = []
        for line in self.proc.stdout:
            try:
                out = json.loads(line)
            except json.JSONDecodeError:
                seen.append(line)
                continue
            if key in out:
                return out
        self.proc.wait()
        self.err.seek(0)
        sys.exit(
            f"{self.what} failed (exit {self.proc.returncode}):\n{''.join(seen)[-2000:]}{self.err.read()[-4000:]}"
        )

    def timed(self) -> float:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return self._expect("seconds")["seconds"]

    def finish(self) -> dict:
        self.proc.stdin.close()
        out = self._expect("rss_mb")
        self.proc.wait()
        return out


def _interleaved(workers: list[_Worker], repeat: int) -> list[dict]:
    """``repeat`` rounds of one timed update per worker in turn, so a slow spell of a shared machine
    falls on every path alike rather than on whichever ran then; each path's best time."""
    for _ in range(repeat):
        for w in workers:
            w.timed()
    return [w.finish() for w in workers]


def bench_update(a: argparse.Namespace) -> None:
    """Per size: the update through ``Learner.update`` against the baseline (``hf_padded``: the
    plain HF step, same precision; a commit of this repo; or the frozen list path), then, on a CPU
    with bf16 units, the same update in bf16 mixed precision against its own float32 time."""
    from agent_r1.cpus import bf16_units

    tmp = Path(tempfile.mkdtemp())
    base_name = {"hf_padded": "hf_padded", "list": "list_path"}.get(a.baseline, f"main_{a.baseline}")
    base_env = dict(os.environ)
    if base_name.startswith("main_"):
        base_env["PYTHONPATH"] = str(_baseline_tree(a.baseline, tmp))  # its agent_r1 before the installed one
    common = [f"--repeat={a.repeat}", f"--threads={a.threads}", *[f"--override={o}" for o in a.overrides]]
    for size in a.sizes.split(","):
        model = str(build_model(tmp / size, SIZES[size]["model"]))
        workers = [
            _Worker(["--update-worker", "batch", size, model, *common], os.environ, f"batch at {size}")
        ]
        if a.baseline == "hf_padded":
            workers.append(
                _Worker(["--hf-worker", size, model, "float32", *common], os.environ, f"hf at {size}")
            )
        else:
            path = "list" if a.baseline == "list" else "batch"
            workers.append(
                _Worker(["--update-worker", path, size, model, *common], base_env, f"{base_name} at {size}")
            )
        half_ok = bf16_units()
        if half_ok:
            workers.append(
                _Worker(
                    ["--update-worker", "batch", size, model, *common, "--override=model.dtype=bfloat16"],
                    os.environ,
                    f"bf16 at {size}",
                )  # fmt: skip
            )
        ours, ref, *half = _interleaved(workers, a.repeat)
        print(
            f"{size}: {SIZES[size]['records']['trajectories']} trajectories, {int(ours['tokens'])} merged tokens; "
            f"update {ours['seconds']:.3f} s (Learner.update) vs {ref['seconds']:.3f} s ({base_name}); "
            f"peak RSS {ours['rss_mb']:.0f} MB vs {ref['rss_mb']:.0f} MB; loss/pg {ours['loss']:.6f} vs {ref['loss']:.6f}"
        )
        print(
            f"BENCH learner_update_{size} seconds={ours['seconds']:.3f} baseline={base_name} "
            f"ratio={ref['seconds'] / ours['seconds']:.2f}"
        )
        print(
            f"BENCH learner_update_{size}_peak_rss mb={ours['rss_mb']:.0f} baseline={base_name} "
            f"ratio={ref['rss_mb'] / ours['rss_mb']:.2f}"
        )
        if not half_ok:
            print(f"{size}: bf16 skipped (this CPU has neither AVX512_BF16 nor AMX-BF16)")
            continue
        half = half[0]
        print(f"{size}: update in bf16 {half['seconds']:.3f} s vs {ours['seconds']:.3f} s in float32; "
              f"loss/pg {half['loss']:.6f} vs {ours['loss']:.6f}")  # fmt: skip
        print(
            f"BENCH learner_update_{size}_bf16 seconds={half['seconds']:.3f} baseline=fp32 "
            f"ratio={ours['seconds'] / half['seconds']:.2f}"
        )


def bench_share(a: argparse.Namespace) -> None:
    """Per size: ``Learner.update`` with ``optim.share_prefix=16`` against itself without, one
    timed update each in turn (``_interleaved``); the same loss within float32 summation order."""
    tmp = Path(tempfile.mkdtemp())
    common = [f"--repeat={a.repeat}", f"--threads={a.threads}", *[f"--override={o}" for o in a.overrides]]
    for size in ("smollm2_grpo", "quickstart"):
        model = str(build_model(tmp / size, SIZES[size]["model"]))
        shared, plain = _interleaved(
            [
                _Worker(["--update-worker", "batch", size, model, *common, "--override=optim.share_prefix=16"],
                        os.environ, f"shared at {size}"),
                _Worker(["--update-worker", "batch", size, model, *common], os.environ, f"plain at {size}"),
            ],
            a.repeat,
        )  # fmt: skip
        print(
            f"{size}: update {shared['seconds']:.3f} s shared vs {plain['seconds']:.3f} s plain; "
            f"loss/pg {shared['loss']:.6f} vs {plain['loss']:.6f}"
        )
        print(
            f"BENCH learner_shared_prefix_{size} seconds={shared['seconds']:.3f} baseline=unshared "
            f"ratio={plain['seconds'] / shared['seconds']:.2f}"
        )


def hf_worker(a: argparse.Namespace) -> None:
    """The peer: a plain HF/TRL-style update on the same records -- one right-padded row per
    trajectory (its merged stream: prompt, actions and feedback), logits at every position, the
    GRPO clip loss on the action tokens (token mean; one optimizer step, so the old logprobs are
    the step's own, as in TRL with one iteration), AdamW (fused where torch has it), clip 1.0.
    Driven by the parent like ``update_worker`` (``_serve``)."""
    size, model_dir, dtype = a.hf_worker
    torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM

    from agent_r1.algos.advantages import compute_advantages
    from agent_r1.learner.batch import LearnerBatch
    from agent_r1.records.synth import synth_table

    spec = SIZES[size]
    b = LearnerBatch.from_table(synth_table(seed=0, vocab=spec["model"]["vocab"], **spec["records"]))
    adv = b.per_token(compute_advantages("grpo", b.inputs).step_adv.float())
    T, starts = b.num_trajectories, b.traj_tokens
    width = int(np.diff(starts).max())
    ids = torch.zeros(T, width, dtype=torch.long)
    attn = torch.zeros(T, width, dtype=torch.long)
    label_row = np.searchsorted(starts, b.label_pos, side="right") - 1
    label_col = b.label_pos - starts[label_row]  # the token's column; its logits sit one before
    for t in range(T):
        n = starts[t + 1] - starts[t]
        ids[t, :n] = torch.from_numpy(b.stream_tokens[starts[t] : starts[t + 1]])
        attn[t, :n] = 1
    rows, cols = torch.from_numpy(label_row), torch.from_numpy(label_col)
    mask = b.action_mask.float()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).train()
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    except (RuntimeError, TypeError):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def update() -> dict:
        logits = model(input_ids=ids, attention_mask=attn).logits
        logp = torch.log_softmax(logits[rows, cols - 1].float(), -1).gather(1, ids[rows, cols, None])[:, 0]
        ratio = torch.exp(logp - logp.detach())
        pg = -torch.minimum(ratio * adv, ratio.clamp(1 - 0.2, 1 + 0.28) * adv)
        loss = (pg * mask).sum() / mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return {"tokens": float(b.num_stream_tokens), "loss": float(loss)}

    _serve(lambda it: update())


# ---- 2. prefix merging vs per-step rows -------------------------------------------------------------
def _merge_setup(a, tp: int, d: str):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from agent_r1.learner.backend.cpu_compat import apply
    from agent_r1.learner.batch import LearnerBatch
    from agent_r1.records.synth import synth_table
    from megatron_bridge import BridgeConfig, build_gpt_model, load_hf_weights

    apply()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(0)
    cfg = AutoConfig.from_pretrained(d)
    model = build_gpt_model(cfg, BridgeConfig(tp=tp))
    load_hf_weights(model, load_file(f"{d}/model.safetensors"), cfg)
    t = synth_table(a.trajectories, group_size=4, max_steps=a.steps, seed=0, prompt_len=(96, 160),
                    action_len=(24, 64), feedback_len=(16, 48), vocab=cfg.vocab_size)  # fmt: skip
    return model, cfg, LearnerBatch.from_table(t)


def _merged_step(model, cfg, micro, n_labels, group=None, rank=0) -> float:
    from agent_r1.learner.forward import packed_forward
    from agent_r1.learner.logprobs import packed_logprobs

    model.zero_grad(set_to_none=True)
    total = 0.0
    for mb in micro:  # gradient accumulation over packed micro-batches
        logits = packed_forward(model, mb, mb.label_pos - 1)
        lp, _ = packed_logprobs(
            logits, mb.tokens[mb.label_pos], group, rank * logits.shape[-1], cfg.vocab_size
        )
        loss = -lp.sum() / n_labels
        loss.backward()
        total += float(loss.detach())
    return total


def bench_merge(a: argparse.Namespace) -> None:
    from agent_r1.models.tiny import build_tiny_model

    _init(a.threads)
    d = build_tiny_model(tempfile.mkdtemp() + "/m", [f"w{i} " * 3 for i in range(3000)], arch="qwen3",
                         vocab_size=a.vocab, hidden=a.hidden, layers=a.layers, heads=4, kv_heads=2)  # fmt: skip
    model, cfg, b = _merge_setup(a, 1, str(d))
    micro = b.micro_batches(None, a.micro_tokens)
    n_labels = b.num_action_tokens
    obs = b.table.column("obs_token_ids").to_pylist()
    act = b.table.column("action_token_ids").to_pylist()
    seqs = [o + x for o, x in zip(obs, act, strict=True)]
    L = max(map(len, seqs))
    rows = torch.zeros(len(seqs), L, dtype=torch.int64)
    mask = torch.zeros(len(seqs), L - 1, dtype=torch.bool)
    for i, (s, o) in enumerate(zip(seqs, obs, strict=True)):
        rows[i, : len(s)] = torch.tensor(s)
        mask[i, len(o) - 1 : len(s) - 1] = True

    def padded_step() -> float:
        model.zero_grad(set_to_none=True)
        B, S = rows.shape
        logits = model(rows, torch.arange(S).expand(B, S), None)  # causal; padding sits after each row
        logp = torch.log_softmax(logits[:, :-1, : cfg.vocab_size].float(), -1).gather(-1, rows[:, 1:, None])[
            ..., 0
        ]
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

    t_m, l_m = best(lambda: _merged_step(model, cfg, micro, n_labels))
    t_p, l_p = best(padded_step)
    tok_m, tok_p, tok_unpadded = b.num_stream_tokens, rows.numel(), sum(map(len, seqs))
    print(f"{b.num_trajectories} trajectories, {b.num_steps} steps, {len(micro)} packed micro-batches; "
          f"loss merged {l_m:.6f} vs per-step {l_p:.6f} (same objective)")  # fmt: skip
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
    if a.no_tp2:
        return
    # the same merged step at TP2: two processes with one thread each (the TP1 run had 2 threads)
    port, out = _free_port(), tempfile.mktemp(suffix=".json")
    args = [f"--trajectories={a.trajectories}", f"--steps={a.steps}", f"--hidden={a.hidden}",
            f"--layers={a.layers}", f"--vocab={a.vocab}", f"--repeat={a.repeat}", f"--micro-tokens={a.micro_tokens}"]  # fmt: skip
    procs = [
        subprocess.Popen([sys.executable, __file__, *args, "--tp2-worker", str(r), port, out, str(d)])
        for r in range(2)
    ]
    assert all(p.wait() == 0 for p in procs)
    t_tp2 = json.loads(Path(out).read_text())["seconds"]
    print(
        f"time: merged step TP1 (1 process x 2 threads) {t_m:.3f} s, TP2 (2 processes x 1 thread) {t_tp2:.3f} s"
    )
    print(f"BENCH learner_tp2_step seconds={t_tp2:.3f} baseline=tp1_2threads ratio={t_m / t_tp2:.2f}")


def tp2_worker(a) -> None:
    rank, port, out, model_dir = int(a.tp2_worker[0]), a.tp2_worker[1], a.tp2_worker[2], a.tp2_worker[3]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from megatron.core import parallel_state as ps

    model, cfg, b = _merge_setup(a, 2, model_dir)
    micro = b.micro_batches(None, a.micro_tokens)
    group = ps.get_tensor_model_parallel_group()

    def step() -> None:
        _merged_step(model, cfg, micro, b.num_action_tokens, group, rank)

    step()
    ts = []
    for _ in range(a.repeat):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        dist.barrier()
        ts.append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(json.dumps({"seconds": min(ts)}))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=("update", "share", "merge"), help="run one benchmark (default: all)")
    ap.add_argument("--sizes", default="quickstart,smollm2", help="update benchmark sizes")
    ap.add_argument(
        "--baseline",
        default="hf_padded",
        help="update baseline: hf_padded (the plain HF step), a git commit of this repo, or 'list'",
    )
    ap.add_argument(
        "--override", dest="overrides", action="append", default=[], help="config override (update)"
    )
    ap.add_argument("--trajectories", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument(
        "--repeat", type=int, default=3, help="rounds of timed updates after one warm-up each (best is kept)"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--micro-tokens", type=int, default=1024, help="packed tokens per micro-batch (merge)")
    ap.add_argument("--no-tp2", action="store_true", help="skip the TP2-vs-TP1 step time")
    ap.add_argument("--update-worker", nargs=3, metavar=("PATH", "SIZE", "MODEL"), help=argparse.SUPPRESS)
    ap.add_argument("--hf-worker", nargs=3, metavar=("SIZE", "MODEL", "DTYPE"), help=argparse.SUPPRESS)
    ap.add_argument("--tp2-worker", nargs=4, metavar=("RANK", "PORT", "OUT", "MODEL"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.update_worker:
        return update_worker(a)
    if a.tp2_worker:
        return tp2_worker(a)
    if a.hf_worker:
        return hf_worker(a)
    if a.only in (None, "update"):
        bench_update(a)
    if a.only in (None, "share"):
        bench_share(a)
    if a.only in (None, "merge"):
        bench_merge(a)


if __name__ == "__main__":
    main()
