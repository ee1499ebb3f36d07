"""One rank of the Qwen3-MoE bridge checks: packed logprobs through Megatron-Core's MoE layer
(top-k router, SequentialMLP experts, the alltoall dispatcher) at TP1, EP2, TP2 with sequence
parallelism (which Megatron-Core requires for MoE at TP > 1) and PP2 equal per-step
recomputation with the HF model, and over two pipeline ranks of two virtual stages each (the
interleaved schedule, two micro-batches); the export gives back every HF tensor by name."""

import torch
import torch.distributed as dist
from megatron_rank import (
    finish,
    forward_logprobs,
    init_rank,
    max_diff_over_ranks,
    per_step_logprobs,
    rank_argv,
    schedule_logprobs,
    synth_batch,
)

# tp, pp, ep, vpp
LAYOUTS = {
    "1x1": (1, 1, 1, 1),
    "ep2": (1, 1, 2, 1),
    "tp2sp": (2, 1, 2, 1),
    "pp2": (1, 2, 1, 1),
    "pp2vpp2": (1, 2, 1, 2),
}


def hf_step_logprobs(hf, table) -> torch.Tensor:
    """``per_step_logprobs`` with gradients: every step's obs + action on its own."""
    out = []
    for obs, act in zip(
        table.column("obs_token_ids").to_pylist(), table.column("action_token_ids").to_pylist(), strict=True
    ):
        ids = torch.tensor([obs + act])
        logp = torch.log_softmax(hf(input_ids=ids).logits[0], -1)
        out.append(logp[len(obs) - 1 : -1].gather(1, ids[0, len(obs) :, None])[:, 0])
    return torch.cat(out)


def grad_diff(model, packed, vocab: int, w, ref: dict, world: int) -> float:
    """max |grad - HF's| of layer 0's router and every expert's gate|up and down, after the same
    weighted logprob sum's backward through Megatron (experts gathered over the EP group; before
    DDP's reduction, so per rank; with sequence parallelism each TP rank routed its own slice of
    the tokens: the router's and experts' gradients are the sum over the TP ranks)."""
    from megatron.core import parallel_state as ps

    from agent_r1.learner.forward import packed_forward
    from agent_r1.learner.logprobs import packed_logprobs

    model.zero_grad()
    logits = packed_forward(model, packed, packed.label_pos - 1)
    v0 = ps.get_tensor_model_parallel_rank() * logits.shape[-1]
    lp, _ = packed_logprobs(
        logits, packed.tokens[packed.label_pos], ps.get_tensor_model_parallel_group(), v0, vocab
    )
    (lp.double() * w[packed.act_index]).sum().backward()
    params = dict(model.named_parameters())
    m = "decoder.layers.0.mlp."
    per = len([n for n in params if n.startswith(m + "experts.local_experts.") and n.endswith("fc1.weight")])
    got = {"router": params[m + "router.weight"].grad}
    for key, name in (("gate_up", "linear_fc1"), ("down", "linear_fc2")):
        local = torch.stack([params[f"{m}experts.local_experts.{i}.{name}.weight"].grad for i in range(per)])
        parts = [torch.empty_like(local) for _ in range(ps.get_expert_model_parallel_world_size())]
        dist.all_gather(parts, local, group=ps.get_expert_model_parallel_group())
        # without sequence parallelism every rank routed the whole batch: an expert's gradient
        # holds each EP rank's copy of the tokens (Megatron's DDP then divides by the data-parallel
        # size); with it each TP rank routed its own half, and an expert saw every token once
        got[key] = torch.cat(parts) / (len(parts) // ps.get_tensor_model_parallel_world_size())
    if ps.get_tensor_model_parallel_world_size() > 1:  # the router saw each rank's half
        dist.all_reduce(got["router"], group=ps.get_tensor_model_parallel_group())
    diff = max(float((got[k].double() - ref[k]).abs().max()) for k in ref)
    allres = [None] * world
    dist.all_gather_object(allres, diff)
    return max(allres)


def main() -> None:
    rank, world, port, model_dir, out = rank_argv()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float64, experts_implementation="eager"
    ).eval()
    batch = synth_batch(hf.config.vocab_size, n=4, seed=1, max_steps=5, longer=True)
    ref = per_step_logprobs(hf, batch.table)
    (packed,) = batch.micro_batches(None, 10**9, pad_to=2)  # sequence parallel: halves at TP 2
    # gradients of sum(w * logprob) over every action token, per step through HF (float64; the
    # router's load-balancing loss off on both sides: HF adds it only with output_router_logits)
    w = torch.linspace(-1.0, 1.0, len(ref), dtype=torch.float64)
    hf.zero_grad()
    (hf_step_logprobs(hf, batch.table) * w).sum().backward()
    layer = hf.model.layers[0].mlp
    ref_grads = {"router": layer.gate.weight.grad, "gate_up": layer.experts.gate_up_proj.grad}
    ref_grads["down"] = layer.experts.down_proj.grad

    init_rank(rank, world, port)
    import megatron.core  # noqa: F401
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from agent_r1.learner.backend.cpu_compat import apply
    from megatron_bridge import BridgeConfig, build_gpt_chunks, export_hf_weights, load_hf_weights

    apply()
    cfg = AutoConfig.from_pretrained(model_dir)
    cfg.router_aux_loss_coef = 0.0
    state = load_file(f"{model_dir}/model.safetensors")
    results = {}
    two = batch.micro_batches(None, 10**9, count=2)  # the interleaved schedule: groups of pp
    for layout, (tp, pp, ep, vpp) in LAYOUTS.items():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=1,
        )
        model_parallel_cuda_manual_seed(0)
        chunks = build_gpt_chunks(cfg, BridgeConfig(tp=tp, pp=pp, ep=ep, sp=tp > 1, vpp=vpp))
        for model in chunks:
            load_hf_weights(model, state, cfg)
        model = chunks[0]
        experts = [n for n, _ in model.named_parameters() if ".local_experts." in n and "layers.0." in n]
        results[f"{layout}_local_experts"] = len(experts) // 2
        if vpp == 1:
            lp = forward_logprobs(model, packed, cfg.vocab_size, chunk=7)
        else:
            lp = schedule_logprobs(chunks, two, cfg.vocab_size, batch.num_action_tokens)
        results[layout] = max_diff_over_ranks(lp, ref, world)
        if pp == 1:
            results[f"{layout}_grad_diff"] = grad_diff(model, packed, cfg.vocab_size, w, ref_grads, world)
        exported = {k: v for m in chunks for k, v in export_hf_weights(m, cfg)}
        stage = [None] * world
        dist.all_gather_object(stage, {k: float((v - state[k]).abs().max()) for k, v in exported.items()})
        merged = {k: v for s in stage for k, v in s.items()}
        results[f"{layout}_export_names"] = sorted(merged) == sorted(state)
        results[f"{layout}_export_diff"] = max(merged.values())
        results[f"{layout}_expert_holders"] = sum(any(".experts." in k for k in st) for st in stage)
        ps.destroy_model_parallel()
    finish(rank, results, out)


if __name__ == "__main__":
    main()
