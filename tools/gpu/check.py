#!/usr/bin/env python
"""The prepared GPU check (run by tools/gpu/check.sh on one CUDA GPU, nothing fetchable).

Each check runs on its own (a failure is reported and the next check runs), prints PASS/FAIL with
its numbers, and the measured ones end with ``BENCH`` lines against a baseline run in the same
process:

1. ``bridge_parity_bf16``  -- Megatron-Core (built by megatron_bridge, bf16, on the GPU) against
   the HF model in bf16 and fp32 on a packed, prefix-merged ``LearnerBatch`` micro-batch: the
   Megatron bf16 logprobs are as close to fp32 as HF's own bf16 ones.
2. ``learner_update``      -- ``Learner.update`` (PPO-clip, GRPO advantages) from a
   ``LearnerBatch`` at SmolLM2-135M size in bf16 over NCCL: tokens/s and MFU; baseline: the HF
   model trained on the same steps as per-step padded rows (the layout verl/Agent-R1 use).
3. ``engine_generate``     -- the embedded engine generating on the GPU: tokens/s, greedy
   output equal to HF ``generate``; baseline: HF ``generate`` on the same prompts.
4. ``weight_push_ipc``     -- the learner's HF-named weights pushed to an ``agent-r1 serve``
   process on the same GPU through CUDA IPC (``/update_weights_from_tensor``, as colocated SGLang
   takes them; NCCL refuses two ranks on one GPU), checked by ``/get_weights_by_name``; GB/s;
   baseline: safetensors on local disk + ``/update_weights_from_disk``.

5. ``plan_vs_gpu``         -- ``agent-r1 plan``'s dry run of a small GRPO run (in a process that sees
   no GPU) against the same update on the GPU (``torch.cuda.max_memory_allocated``): every term
   within 25 %; ``fp8_update`` -- one learner update with ``model.precision=fp8`` when Transformer
   Engine is installed (says so and passes when it is not).

6. ``vision_language``     -- a tiny Qwen2-VL on the device in fp32: the engine's logprobs with
   an image (tower features and pads' rows on the GPU) and the learner's (Megatron local spec,
   mRoPE, the vision tower as a submodule, a ``LearnerBatch`` from records with images) against
   transformers' own model; no baseline (a correctness check).
7. ``moe_update``          -- a tiny Qwen3-MoE on the device: the engine's and the learner's
   (Megatron-Core's MoE layer, alltoall dispatcher) logprobs against transformers' own model, one
   PPO step of the learner (finite gradient norm, the routers' token shares); a correctness check.

``--cpu`` runs the same checks on the CPU at a small size (fp32, gloo, shared-memory IPC): a
smoke test of this script, not a measurement.

    python tools/gpu/check.py [--cpu] [--out results.json] [--peak-tflops 989]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools" / "bench"))

CHECKS = []
BENCH: list[str] = []


def check(fn):
    CHECKS.append(fn)
    return fn


def bench(name: str, metric: str, value: float, baseline: str, ratio: float) -> None:
    line = f"BENCH {name} {metric}={value:.4g} baseline={baseline} ratio={ratio:.3g}"
    BENCH.append(line)
    print(line, flush=True)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Ctx:
    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.device = torch.device("cpu") if a.cpu else torch.device("cuda", 0)
        self.dtype = "float32" if a.cpu else "bfloat16"
        self.tmp = Path(tempfile.mkdtemp(prefix="agent_r1_gpu_"))
        from learner import build_model  # tools/bench/learner.py

        shape = (
            dict(arch="llama", vocab=2048, hidden=128, layers=2, heads=4, kv_heads=2, ffn=256)
            if a.cpu
            else dict(arch="llama", vocab=49152, hidden=576, layers=30, heads=9, kv_heads=3, ffn=1536)
        )
        self.model_dir = Path(a.model) if a.model else build_model(self.tmp / "model", shape)
        self._tokenizer()

    def _tokenizer(self) -> None:
        """The engine needs a tokenizer: a byte-level BPE over the model's vocabulary size."""
        if (self.model_dir / "tokenizer.json").exists():
            return
        from transformers import AutoConfig

        from agent_r1.models.tiny import train_tokenizer

        vocab = AutoConfig.from_pretrained(self.model_dir).vocab_size
        texts = [f"step {i} obs {i * 7 % 97} action {i * 13 % 89} " * 4 for i in range(4000)]
        train_tokenizer(texts, min(vocab, 4096)).save_pretrained(self.model_dir)

    def records(self, trajectories: int):
        from transformers import AutoConfig

        from agent_r1.records.synth import synth_table

        vocab = AutoConfig.from_pretrained(self.model_dir).vocab_size
        return synth_table(trajectories, group_size=8, max_steps=4, seed=0, prompt_len=(64, 160),
                           action_len=(16, 96), feedback_len=(8, 48), vocab=vocab)  # fmt: skip


# ---- 0. the machine -------------------------------------------------------------------------------
@check
def environment(c: Ctx) -> dict:
    import megatron.core

    info = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0) if c.device.type == "cuda" else "cpu",
        "megatron_core": getattr(megatron.core, "__version__", "?"),
    }
    try:
        import transformer_engine  # noqa: F401

        info["transformer_engine"] = transformer_engine.__version__
    except ImportError:
        info["transformer_engine"] = None
    return info


# ---- 1. bridge parity --------------------------------------------------------------------------------
@check
def bridge_parity_bf16(c: Ctx) -> dict:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from agent_r1.learner.batch import LearnerBatch
    from agent_r1.learner.forward import packed_forward
    from agent_r1.learner.logprobs import packed_logprobs
    from megatron_bridge import BridgeConfig, build_gpt_model, load_hf_weights

    cfg = AutoConfig.from_pretrained(c.model_dir)
    model_parallel_cuda_manual_seed(0)
    mg = build_gpt_model(cfg, BridgeConfig(dtype=c.dtype))
    state = {}
    for f in sorted(c.model_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))
    load_hf_weights(mg, state, cfg)
    mg.to(c.device).eval()
    b = LearnerBatch.from_table(c.records(8), c.device)
    (mb,) = b.micro_batches(None, 10**9)
    targets = mb.tokens[mb.label_pos]
    with torch.no_grad():
        lp_mg, _ = packed_logprobs(
            packed_forward(mg, mb, mb.label_pos - 1), targets, vocab_size=cfg.vocab_size
        )
        ref = {}
        for dt in ("float32", c.dtype):
            hf = (
                AutoModelForCausalLM.from_pretrained(c.model_dir, dtype=getattr(torch, dt))
                .to(c.device)
                .eval()
            )
            out = []
            for a_, e in mb.bounds:  # one merged sequence per forward
                logits = hf(input_ids=mb.tokens[a_:e].unsqueeze(0)).logits[0].float()
                sel = (mb.label_pos >= a_) & (mb.label_pos < e)
                pos = mb.label_pos[sel] - a_
                out.append(torch.log_softmax(logits[pos - 1], -1).gather(1, mb.tokens[a_:e][pos, None])[:, 0])
            ref[dt] = torch.cat(out)
            del hf
    err_mg = float((lp_mg.float() - ref["float32"]).abs().max())
    err_hf = float((ref[c.dtype] - ref["float32"]).abs().max())
    ok = err_mg <= 2 * err_hf + 0.02
    return {"ok": ok, "tokens": mb.num_tokens, "megatron_vs_fp32": err_mg, "hf_bf16_vs_fp32": err_hf}


# ---- 2. the learner update -------------------------------------------------------------------------------
def _params(model) -> int:
    return sum(p.numel() for p in model.parameters())


@check
def learner_update(c: Ctx) -> dict:
    from transformers import AutoModelForCausalLM

    from agent_r1.train.config import load_config
    from agent_r1.train.learner_rank import Learner

    cfg = load_config(
        [f"model.path={c.model_dir}", "model.build=null", f"model.dtype={c.dtype}", "trainer.progress=false",
         f"parallel.backend={'gloo' if c.a.cpu else 'nccl'}", "optim.micro_tokens=8192", "optim.lr=1e-5",
         # the config refuses NCCL under the local launcher; the check starts no launcher
         *([] if c.a.cpu else ["cluster=slurm_gpu"])]
    )  # fmt: skip
    learner = Learner(cfg)
    table = c.records(16 if c.a.cpu else 64)
    learner.update(table, 1, 0)  # warm-up
    times, m = [], {}
    for it in range(1, 1 + c.a.repeat):
        _sync(c.device)
        t0 = time.perf_counter()
        m = learner.update(table, 1, it)
        _sync(c.device)
        times.append(time.perf_counter() - t0)
    t = min(times)
    tokens = m["train/tokens"]
    n_params = _params(learner.actor.module)
    mfu = 6 * n_params * tokens / t / (c.a.peak_tflops * 1e12)
    del learner
    torch.cuda.empty_cache() if c.device.type == "cuda" else None

    # baseline: the HF model on the same steps as per-step padded rows, one AdamW step
    hf = AutoModelForCausalLM.from_pretrained(c.model_dir, dtype=getattr(torch, c.dtype)).to(c.device).train()
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-5)
    obs, act = table.column("obs_token_ids").to_pylist(), table.column("action_token_ids").to_pylist()
    seqs = [o + x for o, x in zip(obs, act, strict=True)]
    per_step_tokens = sum(map(len, seqs))

    def hf_step() -> None:
        opt.zero_grad(set_to_none=True)
        for i in range(0, len(seqs), 16):  # micro-batches of 16 padded rows
            rows = seqs[i : i + 16]
            L = max(map(len, rows))
            ids = torch.zeros(len(rows), L, dtype=torch.long, device=c.device)
            mask = torch.zeros(len(rows), L, dtype=torch.bool, device=c.device)
            for j, s in enumerate(rows):
                ids[j, : len(s)] = torch.tensor(s, device=c.device)
                mask[j, : len(s)] = True
            logits = hf(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
            (-(lp * mask[:, 1:]).sum() / mask.sum()).backward()
        opt.step()

    hf_step()
    _sync(c.device)
    t0 = time.perf_counter()
    hf_step()
    _sync(c.device)
    t_hf = time.perf_counter() - t0
    hf = opt = None  # free the GPU memory before the next check
    bench("learner_update_tokens", "tokens_per_s", tokens / t, "hf_per_step_padded", t_hf / t)
    bench("learner_update_mfu", "mfu", mfu, f"peak_{c.a.peak_tflops:g}_tflops", mfu)
    return {"ok": all(v == v for v in m.values()), "seconds": t, "merged_tokens": tokens,
            "per_step_tokens": per_step_tokens, "hf_seconds": t_hf, "mfu": mfu, "loss/pg": m.get("loss/pg")}  # fmt: skip


# ---- 2b. the plan against the GPU -------------------------------------------------------------------------
PLAN_OVERRIDES = ["rollout.group_size=8", "rollout.prompts_per_iteration=8", "episode.max_steps=4",
                  "episode.max_obs_tokens=1024", "episode.max_action_tokens=128", "optim.micro_tokens=4096",
                  "algorithm=grpo", "parallel.backend=nccl", "cluster=slurm_gpu"]  # fmt: skip


@check
def plan_vs_gpu(c: Ctx) -> dict:
    """``agent-r1 plan``'s dry run (in a process that sees no GPU) against the same update on the GPU:
    weights, gradient buffers and optimizer state from the learner's tensors, the update's peak from
    ``torch.cuda.max_memory_allocated``; the peaks within 25 % (the dry run models fused kernels
    where this machine may run the local spec's)."""
    if c.device.type != "cuda":
        return {"ok": True, "skipped": "needs a GPU (the dry run itself is tested on the CPU)"}
    from agent_r1.launch.plan import StagePlan, measure_update
    from agent_r1.train.config import load_config
    from agent_r1.train.learner_rank import Learner

    overrides = [f"model.path={c.model_dir}", "model.build=null", f"model.dtype={c.dtype}", *PLAN_OVERRIDES]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "agent_r1.cli", "plan", *overrides, "--json"],
                          capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    planned = json.loads(proc.stdout)["stages"][0]

    class CudaMemory:  # measure_update's tracker interface, from the caching allocator's counters
        live = property(lambda self: torch.cuda.memory_allocated())
        peak = property(lambda self: torch.cuda.max_memory_allocated())
        reset_peak = staticmethod(torch.cuda.reset_peak_memory_stats)

    cfg = load_config([*overrides, "trainer.progress=false"])
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    learner = Learner(cfg)
    real = StagePlan(stage=0, rank=0)
    from transformers import AutoConfig

    measure_update(learner, cfg, AutoConfig.from_pretrained(c.model_dir).vocab_size, CudaMemory(), real)
    real.optimizer -= base  # what was on the GPU before the learner
    del learner
    torch.cuda.empty_cache()
    ratios = {
        k: getattr(real, k) / max(planned[k], 1) for k in ("weights", "grads", "optimizer", "activations")
    }
    bench("plan_activation_peak", "gib", real.activations / 2**30, "agent_r1_plan", ratios["activations"])
    ok = all(0.75 <= r <= 1.25 for r in ratios.values())
    return {"ok": ok, "real": dataclasses.asdict(real), "planned": planned, "real_over_planned": ratios}


@check
def fp8_update(c: Ctx) -> dict:
    """One learner update in FP8 (Transformer Engine's spec, packed streams padded to 16)."""
    if c.device.type != "cuda":
        return {"ok": True, "skipped": "FP8 needs a GPU"}
    try:
        import transformer_engine.pytorch  # noqa: F401
    except (ImportError, RuntimeError) as e:
        return {"ok": True, "skipped": f"Transformer Engine is not installed here ({type(e).__name__}: {e})"}
    from agent_r1.train.config import load_config
    from agent_r1.train.learner_rank import Learner

    cfg = load_config(
        [f"model.path={c.model_dir}", "model.build=null", "model.dtype=bfloat16", "model.precision=fp8",
         "trainer.progress=false", "parallel.backend=nccl", "cluster=slurm_gpu", "optim.micro_tokens=8192"]
    )  # fmt: skip
    learner = Learner(cfg)
    table = c.records(16)
    _sync(c.device)
    t0 = time.perf_counter()
    m = learner.update(table, 1, 0)
    _sync(c.device)
    del learner
    torch.cuda.empty_cache()
    finite = all(v == v and abs(v) != float("inf") for v in m.values())
    return {"ok": finite, "seconds": time.perf_counter() - t0, "loss/pg": m.get("loss/pg"),
            "grad_norm": m.get("grad_norm")}  # fmt: skip


# ---- 3. the embedded engine ------------------------------------------------------------------------------
@check
def engine_generate(c: Ctx) -> dict:
    from transformers import AutoModelForCausalLM

    from agent_r1.engines.embedded.engine import Engine

    n, new = (8, 16) if c.a.cpu else (64, 128)
    eng = Engine(c.model_dir, dtype=c.dtype, device=str(c.device), max_running=n)
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(32, 96, (n,), generator=g).tolist()
    prompts = [torch.randint(10, 1000, (k,), generator=g).tolist() for k in lens]
    sampling = {"temperature": 0.0, "max_new_tokens": new, "ignore_eos": True}

    def run(ps: list[list[int]]):
        reqs = [r for p in ps for r in eng.make_requests(p, sampling)]
        eng.submit(reqs)
        eng.run_until_idle()
        return reqs

    run(prompts[:2])  # warm-up
    _sync(c.device)
    t0 = time.perf_counter()
    outs = run(prompts)
    _sync(c.device)
    t = time.perf_counter() - t0
    produced = sum(len(o.out_ids) for o in outs)
    eng = None
    hf = AutoModelForCausalLM.from_pretrained(c.model_dir, dtype=getattr(torch, c.dtype)).to(c.device).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompts[0]], device=c.device), max_new_tokens=new, do_sample=False,
                          min_new_tokens=new, pad_token_id=0)[0, len(prompts[0]):].tolist()  # fmt: skip
        _sync(c.device)
        t0 = time.perf_counter()
        for i in range(0, n, 16):  # HF generate, left-padded batches of 16
            batch = prompts[i : i + 16]
            L = max(map(len, batch))
            ids = torch.tensor([[0] * (L - len(p)) + p for p in batch], device=c.device)
            att = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in batch], device=c.device)
            hf.generate(
                ids,
                attention_mask=att,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
        _sync(c.device)
        t_hf = time.perf_counter() - t0
    same = next((i for i, (a, b) in enumerate(zip(outs[0].out_ids, ref, strict=False)) if a != b), new)
    bench("engine_generate", "tokens_per_s", produced / t, "hf_generate", t_hf / t)
    # greedy tokens agree until the first bf16 near-tie (at least the first few)
    return {
        "ok": same >= min(8, new),
        "tokens": produced,
        "seconds": t,
        "hf_seconds": t_hf,
        "greedy_prefix_equal": same,
    }


# ---- 4. weight push through CUDA IPC -----------------------------------------------------------------------
def _post(url: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _serve(c: Ctx, device: str, *extra: str) -> tuple[subprocess.Popen, str]:
    """``agent-r1 serve`` of the check's model on ``device``, once it answers /health."""
    port = _port()
    server = subprocess.Popen(
        [sys.executable, "-m", "agent_r1.cli", "serve", "--model", str(c.model_dir), "--port", str(port),
         "--dtype", c.dtype, "--device", device, *extra],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=5)
            return server, url
        except OSError:
            if time.time() > deadline or server.poll() is not None:
                server.kill()
                raise RuntimeError("agent-r1 serve did not come up") from None
            time.sleep(1)


def _new_weights(c: Ctx) -> tuple[dict, int]:
    """The model's weights shifted by 0.01 (weights a server does not hold yet) and their bytes."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(c.model_dir, dtype=getattr(torch, c.dtype)).to(c.device)
    named = {k: (v + 0.01).contiguous() for k, v in hf.state_dict().items()}
    del hf
    return named, sum(v.numel() * v.element_size() for v in named.values())


def _pushed_then_disk(
    c: Ctx, url: str, named: dict, folder: str, version: str
) -> tuple[bool, dict, dict, float]:
    """After a push: whether the server holds ``named`` (a probe of the final norm), its model
    info; then the same weights through ``/update_weights_from_disk`` as ``version`` (the
    baseline): its answer and seconds (safetensors write included)."""
    from safetensors.torch import save_file

    probe = "model.norm.weight"
    got = _post(url + "/get_weights_by_name", {"name": probe, "truncate_size": 4})
    want = named[probe].flatten()[:4].float().tolist()
    same = max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-2
    info = json.loads(urllib.request.urlopen(url + "/get_model_info").read())
    d = c.tmp / folder
    d.mkdir(exist_ok=True)
    t0 = time.perf_counter()
    save_file({k: v.cpu() for k, v in named.items()}, str(d / "model.safetensors"))
    r = _post(url + "/update_weights_from_disk", {"model_path": str(d), "weight_version": version})
    return same, info, r, time.perf_counter() - t0


@check
def weight_push_ipc(c: Ctx) -> dict:
    from agent_r1.weights.sglang import push_weights_ipc

    server, url = _serve(c, str(c.device), "--weight-ipc")
    try:
        named, nbytes = _new_weights(c)
        push_weights_ipc(url, named, "v1")  # warm-up
        _sync(c.device)
        t0 = time.perf_counter()
        push_weights_ipc(url, named, "v2")
        t_ipc = time.perf_counter() - t0
        same, info, r, t_disk = _pushed_then_disk(c, url, named, "weights", "v3")
        bench("weight_push_ipc", "gb_per_s", nbytes / t_ipc / 1e9, "disk_safetensors", t_disk / t_ipc)
        ok = same and info.get("weight_version") == "v2" and r.get("success")
        return {
            "ok": ok,
            "bytes": nbytes,
            "ipc_seconds": t_ipc,
            "disk_seconds": t_disk,
            "weights_equal": same,
        }
    finally:
        server.terminate()
        server.wait(timeout=60)


# ---- 5. weight push over the update group (NCCL between GPUs) --------------------------------------------
@check
def weight_push_group(c: Ctx) -> dict:
    """The disaggregated path: a server on another GPU joins the trainer's update group and gets
    flattened buckets. NCCL needs one GPU per rank, so with a single GPU the server shares it and
    the group is gloo (host copies): the line says which ran."""
    import asyncio

    from agent_r1.weights.sglang import WeightUpdateGroup
    from agent_r1.weights.transport import group_backend

    two = c.device.type == "cuda" and torch.cuda.device_count() >= 2
    backend = group_backend(two)
    server_device = "cuda:1" if two else str(c.device)
    server, url = _serve(c, server_device, "--strict")
    try:
        named, nbytes = _new_weights(c)
        group = WeightUpdateGroup([url], "127.0.0.1", backend=backend)

        async def go() -> float:
            await group.init(timeout_s=120)
            await group.push(named.items(), "w1", 256 << 20)  # warm-up
            _sync(c.device)
            t0 = time.perf_counter()
            await group.push(named.items(), "w2", 256 << 20)
            t = time.perf_counter() - t0
            await group.close()
            return t

        t_push = asyncio.run(go())
        same, info, r, t_disk = _pushed_then_disk(c, url, named, "weights_group", "w3")
        bench(
            f"weight_push_{backend}", "gb_per_s", nbytes / t_push / 1e9, "disk_safetensors", t_disk / t_push
        )
        return {
            "ok": same and info.get("weight_version") == "w2" and r.get("success"),
            "disk_seconds": t_disk,
            "backend": backend,
            "server_device": server_device,
            "bytes": nbytes,
            "seconds": t_push,
            "weights_equal": same,
        }
    finally:
        server.terminate()
        server.wait(timeout=60)


# ---- 6. vision-language model ----------------------------------------------------------------------
@check
def vision_language(c: Ctx) -> dict:
    import random

    from transformers import AutoModelForImageTextToText

    from agent_r1.agent.chat import ChatCodec
    from agent_r1.engines.embedded.engine import Engine
    from agent_r1.learner.actor import Actor
    from agent_r1.learner.batch import LearnerBatch
    from agent_r1.learner.optim import OptimConfig
    from agent_r1.models.tiny import build_tiny_model
    from agent_r1.records.schema import StepRecord, records_to_table
    from agent_r1.vision.images import load_image
    from agent_r1.vision.qwen2_vl import Geometry, image_processor, pixel_values
    from megatron_bridge import BridgeConfig
    from recipes import load_recipe

    data = load_recipe("visual_arithmetic").data
    d = build_tiny_model(c.tmp / "vl", data.corpus(300), arch="qwen2_vl", vocab_size=800, split_digits=True)
    codec = ChatCodec.load(str(d))
    image = load_image(data.render_number(47, random.Random(0)))
    msgs = [
        {"role": "user", "content": [{"type": "text", "text": "Read:"}, {"type": "image", "image": image}]}
    ]
    ids, images = codec.encode_chat_images(msgs)
    eng = Engine(d, device=str(c.device), max_running=4, max_len=512)
    (r,) = eng.make_requests(ids, {"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 1},
                             return_logprob=True, image_data=[image.base64()])  # fmt: skip
    eng.submit([r])
    eng.run_until_idle()
    eng = None
    hf = AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32).to(c.device).eval()
    pv, grid = pixel_values(image_processor(str(d)), images)
    full = torch.tensor([ids + r.out_ids], device=c.device)
    with torch.no_grad():
        logits = hf(input_ids=full, pixel_values=pv.to(c.device), image_grid_thw=grid.to(c.device),
                    mm_token_type_ids=(full == hf.config.image_token_id).int()).logits[0].float()  # fmt: skip
    lp = torch.log_softmax(logits, -1)[len(ids) - 1 : -1].gather(1, full[0, len(ids) :, None])[:, 0].cpu()
    engine_diff = float((lp - torch.tensor(r.out_logprobs)).abs().max())
    rec = StepRecord("t", "g", 0, ids, r.out_ids, r.out_logprobs, [1] * len(r.out_ids), images=[image.hash],
                     image_data={image.hash: image.data}, done=True, reward=1.0)  # fmt: skip
    batch = LearnerBatch.from_table(records_to_table([rec]), c.device, vision=Geometry.of(d))
    actor = Actor(d, BridgeConfig(), OptimConfig(), trainable=False)
    learner_lp = actor.logprobs(batch.micro_batches(None, 4096), batch.num_action_tokens).float().cpu()
    learner_diff = float((learner_lp - lp).abs().max())
    return {
        "ok": engine_diff < 1e-3 and learner_diff < 1e-3,
        "engine_vs_hf": engine_diff,
        "learner_vs_hf": learner_diff,
    }


# ---- 7. mixture of experts -------------------------------------------------------------------------
@check
def moe_update(c: Ctx) -> dict:
    """A tiny Qwen3-MoE (8 experts, top 2) on the device: the engine's sampled logprobs and the
    learner's (Megatron-Core's MoE layer, the alltoall dispatcher) against transformers' own model,
    then one PPO optimizer step of the learner (finite gradient norm, the routers' token shares)."""
    from transformers import AutoModelForCausalLM

    from agent_r1.engines.embedded.engine import Engine
    from agent_r1.learner.actor import Actor
    from agent_r1.learner.actor_steps import PolicyTargets
    from agent_r1.learner.batch import LearnerBatch
    from agent_r1.learner.optim import OptimConfig
    from agent_r1.models.tiny import build_tiny_model
    from agent_r1.records.schema import StepRecord, records_to_table
    from megatron_bridge import BridgeConfig
    from recipes import load_recipe

    d = build_tiny_model(
        c.tmp / "moe", load_recipe("arithmetic_tool").corpus(num=200), arch="qwen3_moe", vocab_size=400
    )
    ids = [1, 5, 9, 14, 30, 2, 7]
    eng = Engine(d, device=str(c.device), max_running=4, max_len=256)
    (r,) = eng.make_requests(ids, {"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 1},
                             return_logprob=True)  # fmt: skip
    eng.submit([r])
    eng.run_until_idle()
    eng = None
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).to(c.device).eval()
    full = torch.tensor([ids + r.out_ids], device=c.device)
    with torch.no_grad():
        logits = hf(input_ids=full).logits[0].float()
    lp = torch.log_softmax(logits, -1)[len(ids) - 1 : -1].gather(1, full[0, len(ids) :, None])[:, 0].cpu()
    engine_diff = float((lp - torch.tensor(r.out_logprobs)).abs().max())
    rec = StepRecord("t", "g", 0, ids, r.out_ids, r.out_logprobs, [1] * len(r.out_ids), done=True, reward=1.0)
    batch = LearnerBatch.from_table(records_to_table([rec]), c.device)
    micro = batch.micro_batches(None, 4096)
    actor = Actor(d, BridgeConfig(), OptimConfig(lr=1e-4))
    learner_lp = actor.logprobs(micro, batch.num_action_tokens)
    learner_diff = float((learner_lp.float().cpu() - lp).abs().max())
    adv = batch.per_token(torch.ones(batch.num_steps, device=c.device))
    metrics, _ = actor.train_step(micro, PolicyTargets(adv, learner_lp), "ppo")
    shares = actor.router_stats.report(1)
    total = sum(v for k, v in shares.items() if k.startswith("moe/expert_share/"))
    return {
        "ok": engine_diff < 1e-3
        and learner_diff < 1e-3
        and math.isfinite(metrics["grad_norm"])
        and abs(total - 1) < 1e-6,
        "engine_vs_hf": engine_diff,
        "learner_vs_hf": learner_diff,
        "grad_norm": metrics["grad_norm"],
        "max_expert_load": shares["moe/max_expert_load"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="smoke-test the checks on the CPU at a small size")
    ap.add_argument("--model", help="an HF model folder (default: a random SmolLM2-135M-shaped model)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H200: 989)")
    ap.add_argument("--only", help="comma-separated check names")
    ap.add_argument("--out", default="gpu_check.json")
    a = ap.parse_args()
    if not a.cpu and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --cpu for a smoke test")
    torch.manual_seed(0)
    c = Ctx(a)
    if a.cpu:
        from transformers import AutoModelForCausalLM

        from agent_r1.learner.backend.cpu_compat import apply

        # an HF model loaded for the first time after Megatron's CPU patches gets wrong rotary
        # buffers (see tests/learner/megatron_worker.py); one load before them avoids it
        AutoModelForCausalLM.from_pretrained(c.model_dir)
        apply()
        torch.multiprocessing.set_sharing_strategy("file_system")
    else:
        torch.cuda.set_device(0)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()))
    dist.init_process_group("gloo" if a.cpu else "nccl", rank=0, world_size=1)
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(1, 1)
    results, failed = {}, []
    for fn in CHECKS:
        if a.only and fn.__name__ not in a.only.split(","):
            continue
        t0 = time.perf_counter()
        try:
            r = fn(c)
            r.setdefault("ok", True)
        except Exception as e:  # report and go on: one broken check must not hide the others
            r = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
        r["wall_s"] = round(time.perf_counter() - t0, 2)
        results[fn.__name__] = r
        if not r["ok"]:
            failed.append(fn.__name__)
        shown = {k: v for k, v in r.items() if k != "trace"}
        print(f"{'PASS' if r['ok'] else 'FAIL'} {fn.__name__} {json.dumps(shown, default=str)}", flush=True)
        if "trace" in r:
            print(r["trace"], file=sys.stderr)
    Path(a.out).write_text(json.dumps({"results": results, "bench": BENCH}, indent=1, default=str))
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
