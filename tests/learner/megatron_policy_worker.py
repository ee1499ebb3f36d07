"""One rank of the packed-policy checks: prefix-merged packed logprobs through Megatron (TP/PP)
equal per-step recomputation with the HF model; the vocab-parallel backward equals autograd."""

import torch
import torch.distributed as dist
from megatron_rank import (
    finish,
    forward_logprobs,
    hf_model_at,
    init_rank,
    layouts,
    max_diff_over_ranks,
    per_step_logprobs,
    rank_argv,
    synth_batch,
)


def main() -> None:
    rank, world, port, model_dir, out = rank_argv()
    torch.set_num_threads(1)  # for the HF reference, before the process group exists
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    batch = synth_batch(hf.config.vocab_size, n=4, seed=1, max_steps=5, longer=True)
    ref = per_step_logprobs(hf, batch.table)
    (packed,) = batch.micro_batches(None, 10**9)  # the whole batch, action tokens in flat order

    init_rank(rank, world, port)
    import megatron.core  # noqa: F401
    from megatron.core import parallel_state as ps
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from agent_r1.learner.attention import install_packed_attention
    from agent_r1.learner.backend.activation import install_fused_swiglu
    from agent_r1.learner.backend.cpu_compat import apply
    from agent_r1.learner.backend.rope import install_fused_rope
    from agent_r1.learner.forward import install_packed_rotary, packed_forward
    from agent_r1.learner.logprobs import packed_logprobs, vocab_parallel_logprob_entropy

    apply()
    cfg = AutoConfig.from_pretrained(model_dir)
    state = load_file(f"{model_dir}/model.safetensors")
    results = {}
    for layout, tp, pp in layouts():
        model = hf_model_at(cfg, state, tp, pp)
        # PackedRotary positions + per-sequence causal SDPA; non-last stages output hidden states;
        # the output layer projects only the rows before action tokens
        lp = forward_logprobs(model, packed, cfg.vocab_size, chunk=7)
        results[layout] = max_diff_over_ranks(lp, ref, world)
        results[f"{layout}_per_sequence_attention"] = install_packed_attention(model) is not None
        results[f"{layout}_native_swiglu"] = install_fused_swiglu(model)  # the MLPs the forward routed
        results[f"{layout}_native_rope"] = install_fused_rope(model)  # and the self-attentions
        if layout == "1x1":  # the same logits as Megatron's own attention with the N x N mask
            with torch.no_grad():
                sdpa = packed_forward(model, packed)
                rows = packed_forward(model, packed, packed.label_pos - 1)
            results["row_select_vs_all_logits"] = float((rows - sdpa[packed.label_pos - 1]).abs().max())
            with torch.no_grad():
                rotary = install_packed_rotary(model)
                rotary.positions = packed.positions
                masked = model(
                    packed.tokens.unsqueeze(0), packed.positions.unsqueeze(0), packed.attention_mask()
                )
                rotary.positions = None
            results["sdpa_vs_mask_logits"] = float((sdpa - masked[0]).abs().max())
    # vocab-parallel backward vs autograd on the full vocabulary (TP = world), untempered and at
    # T = 0.7 through packed_logprobs' chunks (as the learner calls it for a tempered rollout)
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    g = torch.Generator().manual_seed(0)
    full = torch.randn(6, 40, generator=g, dtype=torch.float64)
    targets = torch.randint(0, 40, (6,), generator=g)
    w = torch.randn(6, generator=g, dtype=torch.float64)
    we = torch.randn(6, generator=g, dtype=torch.float64)
    group = ps.get_tensor_model_parallel_group()
    for temp, key in ((1.0, "vocab_parallel"), (0.7, "vocab_parallel_tempered")):
        shard = full.chunk(world, -1)[rank].clone().requires_grad_(True)
        if temp == 1.0:
            lp, ent = vocab_parallel_logprob_entropy(shard, targets, rank * 40 // world, group)
        else:
            lp, ent = packed_logprobs(shard, targets, group, rank * 40 // world, chunk=4, temperature=temp)
        (lp.double() * w + ent.double() * we).sum().backward()
        ref_full = full.clone().requires_grad_(True)
        logp = torch.log_softmax(ref_full / temp, -1)
        ref_lp = logp.gather(1, targets[:, None])[:, 0]
        (ref_lp * w + (-(logp.exp() * logp).sum(-1)) * we).sum().backward()
        grad_diff = float((shard.grad.double() - ref_full.grad.chunk(world, -1)[rank]).abs().max())
        value_diff = float((lp.double() - ref_lp).abs().max())
        allg = [None] * world
        dist.all_gather_object(allg, (grad_diff, value_diff))
        results[f"{key}_grad_diff"] = max(a for a, _ in allg)
        results[f"{key}_value_diff"] = max(b for _, b in allg)
        results[f"{key}_grad_norm"] = float(ref_full.grad.abs().max())
    finish(rank, results, out, indent=None)


if __name__ == "__main__":
    main()
