"""``agent-r1 plan``: a preset's learner and rollout memory per GPU, from a dry run of the real code.

For each pipeline stage, one process stands in for the stage's first rank (TP and DP peers hold
tensors of the same shapes): it joins a fake process group of the preset's world size at that
rank, builds the learner exactly as a real rank does (Megatron-Core model from the HF config,
DDP, distributed optimizer, critic and reference when the algorithm has them) on tensors that
hold no memory (``learner.dry_run``), runs one full update on synthetic records at the preset's
token budgets (every record; each forward-backward schedule over its pp + 1 largest micro-batches,
which reach the steady state's peak: ``dry_run.DryRun.schedule_limit``; the optimizer step) and
the weight push, and
reports per GPU: weights, gradient buffers, optimizer state (with fp32 main weights), the peak of
activations and temporaries above those, the push's own peak, and the total against
``cluster.gpu_mem_gb``. A tensor on the wrong device, a collective NCCL would refuse and a
whole-world gather in the push are errors naming the code. The rollout side is arithmetic on
the HF config: weights per SGLang server GPU at ``rollout.sglang.tp``, KV-cache tokens at
``mem_fraction``, the episodes that fit, and the bytes one push moves.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import queue
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent_r1.engine_spec import engine_spec
from agent_r1.errors import AgentR1Error
from agent_r1.launch.projection import Outcome, compare, long_tail_workload
from agent_r1.launch.projection import table as projection_table
from agent_r1.train.config import TrainConfig, load_config

GiB = 1 << 30
FP8_WEIGHT_BYTES = 2  # Transformer Engine keeps an FP8 copy of each GEMM weight and its transpose
SHIPPED = Path(__file__).resolve().parents[2] / "configs" / "model" / "hf"


class PlanError(AgentR1Error):
    """A preset that cannot be planned, or does not fit."""


def hf_config_dir(cfg: TrainConfig) -> Path:
    """``model.path`` when it holds a config.json, else the architecture shipped for the presets'
    models (``configs/model/hf/<folder name>/config.json``: the public config, no weights)."""
    own = Path(cfg.model.path)
    if (own / "config.json").is_file():
        return own
    shipped = SHIPPED / own.name
    if (shipped / "config.json").is_file():
        return shipped
    raise PlanError(
        f"model.path={cfg.model.path}: no config.json there, and no shipped architecture "
        f"{shipped}/config.json (copy the model's config.json to either place to plan it)"
    )


# ---- one rank position ----------------------------------------------------------------------------
@dataclass
class StagePlan:
    stage: int
    rank: int
    weights: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0  # peak of the update above the persistent state
    push: int = 0  # peak of the weight push above the persistent state (rank 0 holds the HF model)
    push_bytes: int = 0  # rank 0: the HF weights one push sends each server
    fp8_weights: int = 0  # estimated: Transformer Engine's FP8 weight copies (not run here)
    microbatches: int = 0
    max_microbatch_tokens: int = 0
    collectives: int = 0
    error: str | None = None

    @property
    def total(self) -> int:
        return (
            self.weights + self.grads + self.optimizer + self.fp8_weights + max(self.activations, self.push)
        )


def plan_records(cfg: TrainConfig, vocab: int, dp: int):
    """This rank's share of an iteration at the preset's budgets: whole groups, every step's action
    at ``max_action_tokens`` and the final observation near ``max_obs_tokens``."""
    from agent_r1.records.synth import synth_table

    r, e = cfg.rollout, cfg.episode
    groups = max(1, r.prompts_per_iteration // dp)
    steps = e.max_steps
    feedback = 8
    prompt = max(1, e.max_obs_tokens - (steps - 1) * (e.max_action_tokens + feedback))
    return synth_table(
        groups * r.group_size,
        group_size=r.group_size,
        max_steps=steps,
        seed=0,
        prompt_len=(prompt, prompt),
        action_len=(e.max_action_tokens, e.max_action_tokens),
        feedback_len=(feedback, feedback),
        vocab=vocab,
    )


def _stage_export(hf_config: Any, pp: int, vpp: int = 1) -> dict[int, list]:
    """What each stage's first rank sends rank 0 in the push: its HF tensors' names, dtypes and
    shapes (decoder layers by index, over its virtual stages; the final norm and an untied output
    layer on the last stage; the vision tower and the embedding stay on the first, which is rank
    0's own)."""
    import re

    from agent_r1.learner.backend import dry_run
    from megatron_bridge.weights import stage_layers

    text = hf_config.get_text_config()
    n = text.num_hidden_layers
    layers_of = [{i for v in range(vpp) for i in stage_layers(n, pp, p, vpp, v)} for p in range(pp)]
    out: dict[int, list] = {p: [] for p in range(pp)}
    seen = set()
    for n, t in dry_run.hf_state(hf_config).items():
        key = t.untyped_storage()._cdata
        if key in seen:  # a tied output layer is the embedding: sent once, by the first stage
            continue
        seen.add(key)
        layer = re.search(r"\.layers\.(\d+)\.", n)
        if "visual" in n or "embed_tokens" in n:
            stage = 0
        elif layer and "visual" not in n:
            stage = next(p for p, rng in enumerate(layers_of) if int(layer.group(1)) in rng)
        else:
            stage = pp - 1
        out[stage].append((n, t.dtype, tuple(t.shape)))
    return out


def planned_config(overrides: list[str]) -> tuple[TrainConfig, Any, bool]:
    """The run's config as a dry run builds it (the HF config's folder as the model; Transformer
    Engine's FP8 cannot run here: the local spec stands in, with FP8's padding of the packed
    streams), its HF config, and whether it trains in FP8."""
    from transformers import AutoConfig

    from agent_r1.learner.optim import FP8_ALIGNMENT

    cfg = load_config(overrides)
    hf_dir = hf_config_dir(cfg)
    fp8 = cfg.model.precision == "fp8"
    optim = cfg.optim
    if fp8 and optim.pad_multiple == 0:
        optim = dataclasses.replace(optim, pad_multiple=FP8_ALIGNMENT)
    cfg = dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, path=str(hf_dir), precision="default", build=None),
        optim=optim,
        trainer=dataclasses.replace(cfg.trainer, progress=False),
    )
    return cfg, AutoConfig.from_pretrained(hf_dir), fp8


def measure_update(learner: Any, cfg: TrainConfig, vocab: int, memory: Any, out: StagePlan) -> None:
    """Weights, gradient buffers, optimizer state and the update's activation peak of ``learner``
    (built under ``memory``, a ``MemoryTracker``) over one update on the preset's records."""
    models = [m for m in (learner.actor, learner.critic, learner.ref) if m is not None]
    out.weights = sum(_param_bytes(module) for m in models for module in m.modules)
    out.grads = sum(_grad_buffer_bytes(m) for m in models)
    for m in models:  # Adam's moments, as after a first step: the update's peak sits on top of them
        if m.optimizer is not None:
            m._init_optimizer_state()
    table = plan_records(cfg, vocab, cfg.parallel.dp)
    memory.reset_peak()
    learner.update(table, version=1, iteration=0)
    del table
    persistent = memory.live
    out.optimizer = persistent - out.weights - out.grads
    out.activations = memory.peak - persistent


def schedule_limit(pp: int, vpp: int) -> int:
    """How many of an update's largest micro-batches a dry run's schedule needs to reach its
    steady state: 1F1B holds at most pp at once (pp + 1); the interleaved schedule's first rank
    warms up with 2 (pp - 1) + (vpp - 1) pp of them, and runs them in groups of pp."""
    if vpp == 1:
        return pp + 1
    warm = 2 * (pp - 1) + (vpp - 1) * pp + 1
    return -(-warm // pp) * pp


def plan_stage(
    overrides: list[str], stage: int, fused_kernels: bool = True, every_microbatch: bool = False
) -> StagePlan:
    """Dry-run the first rank of pipeline stage ``stage`` (in this process: it patches torch);
    ``every_microbatch`` runs the schedules over all micro-batches, not the pp + 1 largest."""
    import numpy as np
    from megatron.core import parallel_state as ps

    from agent_r1.learner.backend import dry_run
    from agent_r1.learner.optim import pad_multiple

    cfg, hf_config, fp8 = planned_config(overrides)
    p = cfg.parallel
    rank = stage * p.tp * p.cp * p.dp  # Megatron's order tp-cp-ep-dp-pp: (tp 0, cp 0, dp 0, pp stage)
    out = StagePlan(stage=stage, rank=rank)
    run = dry_run.DryRun(
        rank,
        p.learner_ranks,
        backend=p.backend,
        pad_to=pad_multiple(cfg.optim, "default", p.tp if p.sp else 1),
        fused_kernels=fused_kernels,
        schedule_limit=None if every_microbatch else schedule_limit(p.pp, p.vpp),
    )
    with run:
        exports = _stage_export(hf_config, p.pp, p.vpp)
        run.peer_export = lambda src: exports[src // (p.tp * p.cp * p.dp)]
        p.initialize()
        from agent_r1.learner.backend import Backend
        from agent_r1.train.learner_rank import Learner

        learner = Learner(cfg, Backend.planning(run))
        measure_update(learner, cfg, hf_config.get_text_config().vocab_size, run.memory, out)
        persistent = run.live
        out.microbatches, out.max_microbatch_tokens = run.microbatches, run.max_tokens
        run.memory.reset_peak()
        run.pushing = True
        weights = learner.gather_hf_weights()
        bucket = 0
        if weights is not None:  # rank 0 flattens one bucket at a time beside the HF model
            sizes = [t.numel() * t.element_size() for t in weights.values()]
            out.push_bytes = sum(sizes)
            bucket = max(cfg.rollout.bucket_mb << 20, max(sizes))
        out.push = run.peak + bucket - persistent
        del weights
        run.pushing = False
        out.collectives = len(run.collectives)
        if fp8:
            out.fp8_weights = FP8_WEIGHT_BYTES * sum(
                int(np.prod(t.shape))
                for module in learner.actor.modules
                for n, t in module.named_parameters()
                if t.dim() == 2 and "embedding" not in n and "output_layer" not in n
            )
        ps.destroy_model_parallel()
    return out


def _param_bytes(module: Any) -> int:
    seen, n = set(), 0
    for t in module.parameters():
        key = t.untyped_storage()._cdata
        if key not in seen:
            seen.add(key)
            n += t.untyped_storage().nbytes()
    return n


def _grad_buffer_bytes(model: Any) -> int:
    if not getattr(model, "trainable", False):
        return 0
    bufs = [b for chunk in model.chunks for b in (*chunk.buffers, *chunk.expert_parallel_buffers)]
    return sum(b.grad_data.numel() * b.grad_data.element_size() for b in bufs)


def _child(overrides: list[str], stage: int, q: Any) -> None:
    from agent_r1.learner.backend.dry_run import describe

    try:
        q.put(dataclasses.asdict(plan_stage(overrides, stage)))
    except Exception as e:  # reported by the parent, naming the code
        q.put({"stage": stage, "rank": -1, "error": describe(e)})


# ---- the whole preset -----------------------------------------------------------------------------
@dataclass
class RolloutPlan:
    tp: int
    weights_per_gpu: int
    kv_bytes_per_token: int  # per GPU of a server
    kv_tokens: int  # per server
    episode_tokens: int
    episodes_per_server: int
    push_bytes: int  # every weight, in the HF dtype, to each server per push

    @property
    def fits(self) -> bool:
        return self.kv_tokens >= self.episode_tokens


@dataclass
class Plan:
    preset: str
    world: int
    tp: int
    pp: int
    dp: int
    gpu_mem: int
    stages: list[StagePlan] = field(default_factory=list)
    rollout: RolloutPlan | None = None
    projection: list[Outcome] = field(default_factory=list)  # the rollout modes on this cluster
    projection_inputs: str = ""

    @property
    def errors(self) -> list[str]:
        return [f"stage {s.stage}: {s.error}" for s in self.stages if s.error]

    @property
    def fits(self) -> bool:
        return (
            not self.errors
            and all(s.total <= self.gpu_mem for s in self.stages)
            and (self.rollout is None or self.rollout.fits)
        )

    def advice(self) -> list[str]:
        """Which term to change, for each part that does not fit."""
        out = []
        for s in self.stages:
            if s.error is None and s.total > self.gpu_mem:
                big = max(
                    ("optim.micro_tokens (activations)", max(s.activations, s.push)),
                    ("parallel.tp / parallel.pp (weights, gradients, optimizer)", s.weights + s.grads),
                    ("parallel.learner_ranks (more data-parallel ranks shard the optimizer)", s.optimizer),
                    key=lambda kv: kv[1],
                )[0]
                out.append(
                    f"stage {s.stage} needs {s.total / GiB:.1f} GiB of {self.gpu_mem / GiB:.0f}: lower {big}"
                )
        if self.rollout is not None and not self.rollout.fits:
            out.append(
                f"a rollout server holds {self.rollout.kv_tokens} KV tokens, one episode needs "
                f"{self.rollout.episode_tokens}: raise rollout.sglang.tp or rollout.sglang.mem_fraction"
            )
        return out

    def table(self) -> str:
        g = lambda b: f"{b / GiB:8.2f}"  # noqa: E731
        lines = [
            f"plan for {self.preset}: {self.world} learner GPUs = TP {self.tp} x PP {self.pp} x DP {self.dp}, "
            f"{self.gpu_mem / GiB:.0f} GiB each (cluster.gpu_mem_gb)",
            "",
            "learner, per GPU (GiB)   weights    grads  optimizer  fp8 copies  activations  push peak"
            "    total  fits  micro-batches (max tokens)",
        ]
        for s in self.stages:
            if s.error:
                lines.append(f"  stage {s.stage} (rank {s.rank}): ERROR {s.error}")
                continue
            lines.append(
                f"  stage {s.stage} (rank {s.rank:>3})     {g(s.weights)} {g(s.grads)}   {g(s.optimizer)}"
                f"    {g(s.fp8_weights)}     {g(s.activations)}   {g(s.push)} {g(s.total)}  "
                f"{'yes' if s.total <= self.gpu_mem else 'NO ':>4}  {s.microbatches} ({s.max_microbatch_tokens})"
            )
        if self.rollout is not None:
            r = self.rollout
            lines += [
                "",
                f"rollout, per SGLang server (TP {r.tp}): weights {r.weights_per_gpu / GiB:.2f} GiB per GPU, "
                f"KV cache {r.kv_tokens:,} tokens ({r.kv_bytes_per_token} B per token per GPU), "
                f"an episode up to {r.episode_tokens:,} tokens: {r.episodes_per_server:,} at full length "
                f"at once; one push moves {r.push_bytes / GiB:.2f} GiB to each server (staged in "
                "learner rank 0's host memory, one tensor at a time through its GPU)",
            ]
        if self.projection:
            lines += ["", f"rollout modes on this cluster (a model: {self.projection_inputs})"]
            lines += projection_table(self.projection)
        lines += [
            "",
            "fits" if self.fits else "DOES NOT FIT",
            *[f"  - {a}" for a in self.advice()],
            *self.errors,
        ]
        return "\n".join(lines)


def rollout_plan(cfg: TrainConfig, hf_config: Any, push_bytes: int) -> RolloutPlan | None:
    if not engine_spec(cfg.rollout.engine).memory_plan:
        return None
    import torch

    text = hf_config.get_text_config()
    s = cfg.rollout.sglang
    dtype_bytes = torch.empty((), dtype=getattr(torch, cfg.model.dtype)).element_size()
    from agent_r1.learner.backend import dry_run

    unique = {t.untyped_storage()._cdata: t for t in dry_run.hf_state(hf_config).values()}.values()
    weights = sum(t.numel() for t in unique) * dtype_bytes  # tied embeddings once
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_per_gpu = max(1, kv_heads // s.tp)  # SGLang replicates KV heads when TP exceeds them
    per_token = 2 * text.num_hidden_layers * kv_per_gpu * head_dim * dtype_bytes
    gpu = int(cfg.cluster.gpu_mem_gb * GiB)
    free = max(0, int(gpu * s.mem_fraction) - weights // s.tp)
    kv_tokens = free // per_token
    episode = cfg.episode.context_len
    return RolloutPlan(s.tp, weights // s.tp, per_token, kv_tokens, episode, kv_tokens // episode, push_bytes)


def preset_name(overrides: list[str]) -> str:
    return next(
        (o.split("=", 1)[1] for o in overrides if o.lstrip("+").startswith("experiment=")), "(defaults)"
    )


def plan(overrides: list[str]) -> Plan:
    """Dry-run every pipeline stage of the run ``overrides`` describe (one process each)."""
    from transformers import AutoConfig

    cfg = load_config(overrides)
    p = cfg.parallel
    hf_config = AutoConfig.from_pretrained(hf_config_dir(cfg))
    result = Plan(
        preset_name(overrides), p.learner_ranks, p.tp, p.pp, p.dp, int(cfg.cluster.gpu_mem_gb * GiB)
    )
    ctx = mp.get_context("spawn")
    running = []
    for stage in range(p.pp):  # one process per stage (each patches torch for its rank), at once
        q = ctx.Queue()
        proc = ctx.Process(target=_child, args=(list(overrides), stage, q), daemon=True)
        proc.start()
        running.append((stage, proc, q))
    for stage, proc, q in running:
        got = None
        while got is None:
            try:
                got = q.get(timeout=5)
            except queue.Empty:
                if not proc.is_alive():
                    got = {
                        "stage": stage,
                        "rank": -1,
                        "error": f"the planning process died (exit {proc.exitcode})",
                    }
        proc.join()
        result.stages.append(StagePlan(**got))
    result.rollout = rollout_plan(cfg, hf_config, max(s.push_bytes for s in result.stages))
    if result.rollout is not None:
        result.projection, result.projection_inputs = project(cfg, result.rollout)
    return result


# what the projection assumes of one GPU (an H100 SXM): decode streams the weights once per step at
# this share of HBM bandwidth; an update runs at this share of dense bf16 peak
DECODE_BYTES_PER_S = 0.6 * 3.35e12
TRAIN_FLOPS = 0.4 * 989e12
PUSH_BYTES_PER_S = 20e9  # one push, NCCL over the cluster's network


def project(cfg: TrainConfig, r: RolloutPlan) -> tuple[list[Outcome], str]:
    """Sync, one-step-off and streaming on the preset's GPUs for a long-tail agentic workload
    (``projection.long_tail_workload``: steps and tool latencies Pareto, at most
    ``episode.max_steps``), costs from the model's size: a decoded token costs one read of a
    server GPU's weights, a trained token 8 x parameters FLOPs (forward and backward, and the
    recomputed old logprobs) over the learner GPUs, a push its bytes at 20 GB/s."""
    rc, ep = cfg.rollout, cfg.episode
    import torch

    params = r.push_bytes / torch.empty((), dtype=getattr(torch, cfg.model.dtype)).element_size()
    token_s = r.weights_per_gpu / DECODE_BYTES_PER_S
    step_tokens = ep.max_action_tokens + ep.max_obs_tokens / 2
    learners = cfg.parallel.learner_ranks
    per_step_s = 8 * params * step_tokens / (learners * TRAIN_FLOPS)
    slots = max(1, r.episodes_per_server) * rc.servers
    work = long_tail_workload(
        24, rc.prompts_per_iteration * rc.group_size, token_s, max_steps=max(2, ep.max_steps),
        tokens=ep.max_action_tokens,
    )  # fmt: skip
    inputs = (
        f"{rc.servers * r.tp} rollout GPUs holding {slots} episodes at once, {learners} learner GPUs; "
        f"{token_s * 1e3:.1f} ms per decoded token, {per_step_s:.3f} s of update per step record; "
        "steps and tool latencies heavy-tailed, see agent_r1/launch/projection.py"
    )
    return compare(work, slots, r.push_bytes / PUSH_BYTES_PER_S, per_step_s), inputs


def to_json(p: Plan) -> str:
    d = dataclasses.asdict(p)
    d["fits"] = p.fits
    for s, sd in zip(p.stages, d["stages"], strict=True):
        sd["total"] = s.total
    return json.dumps(d, indent=1)
