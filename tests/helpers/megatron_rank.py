"""What every spawned Megatron test rank does around its checks (tests/learner/*_worker.py)."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist


def rank_argv() -> tuple:
    """A spawned rank's command line (``spawn.py`` writes it): rank, world size, port, then the
    test's own arguments (model folders, the output file, ...)."""
    import sys

    rank, world, port, *rest = sys.argv[1:]
    return (int(rank), int(world), port, *rest)


def init_rank(rank: int, world: int, port: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


LAYOUTS = ("1x1", "2x1", "1x2")  # TP x PP over a world of two ranks (1x1: each rank on its own)


def layouts():
    """For each of ``LAYOUTS``: Megatron's model-parallel groups at that TP x PP (seeded as the
    learner seeds them), then torn down. Yields (layout, tp, pp)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    for layout in LAYOUTS:
        tp, pp = map(int, layout.split("x"))
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        model_parallel_cuda_manual_seed(0)
        try:
            yield layout, tp, pp
        finally:
            ps.destroy_model_parallel()


def hf_model_at(cfg, state, tp: int, pp: int):
    """The Megatron model of HF config ``cfg`` at this TP x PP stage, loaded from ``state``."""
    from megatron_bridge import BridgeConfig, build_gpt_model, load_hf_weights

    model = build_gpt_model(cfg, BridgeConfig(tp=tp, pp=pp))
    load_hf_weights(model, state, cfg)
    return model


def ppo_setup(model_dir: str):
    """What the actor checks train on, on a rank whose process group is up (CPU patches applied):
    the synthetic batch, its micro-batches of 40 tokens, fixed +-1 step advantages per token,
    and the optimizer settings."""
    from transformers import AutoConfig

    from agent_r1.learner.backend.cpu_compat import apply
    from agent_r1.learner.optim import OptimConfig

    apply()
    batch = synth_batch(AutoConfig.from_pretrained(model_dir).vocab_size, seed=2)
    micro = batch.micro_batches(None, 40)
    g = torch.Generator().manual_seed(0)
    adv = batch.per_token((torch.randint(0, 2, (batch.num_steps,), generator=g) * 2 - 1).float())
    return batch, micro, adv, OptimConfig(lr=5e-3, clip_grad=1.0, micro_tokens=40)


def gather_first(x, world: int | None = None):
    """The first non-None ``x`` over the ranks (e.g. a result only the last pipeline stage has)."""
    objs = [None] * (world or dist.get_world_size())
    dist.all_gather_object(objs, x)
    return next(o for o in objs if o is not None)


def synth_records(vocab: int, n: int = 6, seed: int = 2, max_steps: int = 4, longer: bool = False):
    """Small synthetic append-mode step records (an Arrow table)."""
    from agent_r1.records.synth import synth_table

    return synth_table(
        n,
        group_size=2,
        max_steps=max_steps,
        seed=seed,
        prompt_len=(5, 12) if longer else (5, 10),
        action_len=(2, 6) if longer else (2, 5),
        feedback_len=(1, 4) if longer else (1, 3),
        vocab=vocab,
    )


def synth_batch(vocab: int, **kw):
    """``synth_records`` as the learner's ``LearnerBatch``."""
    from agent_r1.learner.batch import LearnerBatch

    return LearnerBatch.from_table(synth_records(vocab, **kw))


def per_step_logprobs(hf_model, table) -> torch.Tensor:
    """The independent reference: every step's obs + action through the HF model on its own (no
    merging, no packing); action-token logprobs flat in step order."""
    out = []
    with torch.no_grad():
        for obs, act in zip(
            table.column("obs_token_ids").to_pylist(),
            table.column("action_token_ids").to_pylist(),
            strict=True,
        ):
            ids = torch.tensor([obs + act])
            logp = torch.log_softmax(hf_model(input_ids=ids).logits[0].double(), -1)
            out.append(logp[len(obs) - 1 : -1].gather(1, ids[0, len(obs) :, None])[:, 0])
    return torch.cat(out)


def forward_only(model, step, seq_length: int, micro_batch_size: int = 1) -> None:
    """One micro-batch through Megatron's pipeline schedule without gradients."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    with torch.no_grad():
        get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=iter([None]),
            model=[model],
            num_microbatches=1,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=True,
        )


def forward_logprobs(model, packed, vocab_size: int, vision=None, chunk: int = 2048):
    """The packed stream's action-token logprobs through Megatron's pipeline schedule (forward
    only; the output layer projects only the rows before action tokens); None off the last stage."""
    from megatron.core import parallel_state as ps

    from agent_r1.learner.forward import packed_forward
    from agent_r1.learner.logprobs import packed_logprobs

    got = {}

    def step(it, model):
        out = packed_forward(model, packed, packed.label_pos - 1, vision)
        out = out.unsqueeze(0) if ps.is_pipeline_last_stage() else out

        def loss(output):
            v0 = ps.get_tensor_model_parallel_rank() * output.shape[-1]
            targets = packed.tokens[packed.label_pos]
            lp, _ = packed_logprobs(
                output[0], targets, ps.get_tensor_model_parallel_group(), v0, vocab_size, chunk=chunk
            )
            got["lp"] = lp
            return lp.sum() * 0.0, {}

        return out, loss

    forward_only(model, step, packed.num_tokens)
    return got.get("lp")


def schedule_logprobs(chunks, micro, vocab_size: int, num_tokens: int):
    """The micro-batches' action-token logprobs, flat at their ``act_index``, through Megatron's
    forward-only schedule over this rank's model ``chunks`` (virtual pipeline stages: the
    interleaved schedule); None off the last stage."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from agent_r1.learner.forward import packed_forward
    from agent_r1.learner.logprobs import packed_logprobs

    out = torch.full((num_tokens,), float("nan"), dtype=torch.float64)

    def step(it, model):
        mb = next(it)
        logits = packed_forward(model, mb, mb.label_pos - 1)
        logits = logits.unsqueeze(0) if model.post_process else logits

        def loss(output):
            v0 = ps.get_tensor_model_parallel_rank() * output.shape[-1]
            targets = mb.tokens[mb.label_pos]
            lp, _ = packed_logprobs(output[0], targets, ps.get_tensor_model_parallel_group(), v0, vocab_size)
            out[mb.act_index] = lp.double()
            return lp.sum() * 0.0, {}

        return logits, loss

    with torch.no_grad():
        get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=[iter(micro) for _ in chunks] if len(chunks) > 1 else iter(micro),
            model=chunks,
            num_microbatches=len(micro),
            seq_length=max(mb.num_tokens for mb in micro),
            micro_batch_size=1,
            forward_only=True,
        )
    return out if ps.is_pipeline_last_stage() else None


def max_diff_over_ranks(lp, ref, world: int) -> float:
    """max |lp - ref| where the last stage has ``lp`` (None elsewhere), the same on every rank."""
    diff = None if lp is None else float((lp.double() - ref).abs().max())
    allres = [None] * world
    dist.all_gather_object(allres, diff)
    return max(d for d in allres if d is not None)


def batch_loss(actor, batch, micro, targets) -> float:
    """PPO loss of the batch under the actor's current weights (forward only, the training formula),
    the same on every rank."""
    from agent_r1.algos.losses import LossInputs, loss_config, policy_loss

    lp = actor.logprobs(micro, batch.num_action_tokens)
    out = None
    if lp is not None:
        seg = torch.from_numpy(batch.step_of_token)
        x = LossInputs(lp, targets.old_logprobs, targets.advantages, batch.action_mask, seg, batch.num_steps)
        out = float(policy_loss("ppo", x, loss_config("ppo"))[0])
    return gather_first(out)


def finish(rank: int, results, out: str, indent: int | None = 1) -> None:
    """Rank 0 writes the results; everyone leaves the process group together."""
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=indent)
    dist.barrier()
    dist.destroy_process_group()
