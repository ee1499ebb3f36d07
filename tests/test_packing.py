import torch
from transformers import AutoModelForCausalLM

from agent_r1.learner.packing import (
    merge_chains,
    pack,
    per_step_rows,
    token_logprobs,
    trajectories_from_records,
)
from agent_r1.records.schema import records_from_table
from agent_r1.records.synth import synth_table


def _trajs(n=6, seed=0, max_steps=5, vocab=800):
    t = synth_table(
        n,
        group_size=2,
        max_steps=max_steps,
        seed=seed,
        prompt_len=(5, 12),
        action_len=(2, 6),
        feedback_len=(1, 4),
        vocab=vocab,
    )
    return trajectories_from_records(records_from_table(t))


def test_merge_chains_and_counts():
    steps = [
        {"obs": [1, 2], "action": [3], "prefix_len": 0},
        {"obs": [1, 2, 3, 9], "action": [4, 5], "prefix_len": 3},  # appends
        {"obs": [7, 7], "action": [6], "prefix_len": 0},  # rewritten context: new chain
        {"obs": [7, 7, 6, 8], "action": [2], "prefix_len": 3},
    ]
    assert merge_chains(steps) == [[0, 1], [2, 3]]
    p = pack([steps])
    assert p.tokens.tolist() == [1, 2, 3, 9, 4, 5, 7, 7, 6, 8, 2]
    assert p.positions.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4]
    assert p.cu_seqlens.tolist() == [0, 6, 11]
    assert p.label_pos.tolist() == [2, 4, 5, 8, 10] and p.label_step.tolist() == [0, 1, 1, 2, 3]
    assert p.step_value_pos.tolist() == [1, 3, 7, 9]  # last observation token of each step
    unmerged = pack([steps], merge=False)
    assert unmerged.num_tokens == 3 + 6 + 3 + 5 and unmerged.label_step.tolist() == [0, 1, 1, 2, 3]
    m = p.attention_mask()[0, 0]
    assert not m[5, 0] and m[6, 5] and m[0, 1]  # causal inside, blocked across sequences


def test_prefix_merged_logprobs_equal_per_step_recomputation(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    trajs = _trajs(vocab=model.config.vocab_size)
    merged = pack(trajs)
    with torch.no_grad():
        # one merged sequence per forward (the HF model has no block-diagonal packing)
        lps = []
        for a, b in zip(merged.cu_seqlens[:-1].tolist(), merged.cu_seqlens[1:].tolist(), strict=True):
            logits = model(input_ids=merged.tokens[a:b].unsqueeze(0)).logits[0]
            sel = (merged.label_pos >= a) & (merged.label_pos < b)
            lp, _ = token_logprobs(logits, merged.tokens[a:b], merged.label_pos[sel] - a)
            lps.append(lp)
        merged_lp = torch.cat(lps)
        ref = []
        for steps in trajs:
            for s in steps:
                ids = torch.tensor([s["obs"] + s["action"]])
                logits = model(input_ids=ids).logits[0]
                pos = torch.arange(len(s["obs"]), len(s["obs"]) + len(s["action"]))
                lp, _ = token_logprobs(logits, ids[0], pos)
                ref.append(lp)
    ref_lp = torch.cat(ref)
    assert merged_lp.shape == ref_lp.shape
    assert (merged_lp - ref_lp).abs().max() < 1e-5
    # fewer tokens than the per-step layout
    rows, lengths = per_step_rows(trajs)
    assert merged.num_tokens < int(lengths.sum()) <= rows.numel()


def test_token_logprobs_chunks_and_entropy():
    torch.manual_seed(0)
    logits = torch.randn(20, 50, dtype=torch.float64)
    tokens = torch.randint(0, 50, (20,))
    pos = torch.tensor([1, 4, 5, 19])
    a, ea = token_logprobs(logits, tokens, pos, chunk=3)
    ref = torch.log_softmax(logits, -1)
    assert torch.allclose(a.double(), ref[pos - 1, tokens[pos]].double(), atol=1e-6)
    assert torch.allclose(ea.double(), -(ref.exp() * ref).sum(-1)[pos - 1], atol=1e-5)


def test_micro_batches_cover_every_step_once_within_budget():
    from agent_r1.learner.packing import merged_length, pack_micro_batches

    trajs = _trajs(n=10, seed=3)
    budget = max(merged_length(t) for t in trajs) + 10
    mbs = pack_micro_batches(trajs, budget)
    seen = sorted(i for members, _ in mbs for i in members)
    assert seen == list(range(len(trajs)))
    assert all(p.num_tokens <= budget for _, p in mbs)
    assert sum(p.num_tokens for _, p in mbs) == pack(trajs).num_tokens
    assert sum(int(p.label_pos.numel()) for _, p in mbs) == sum(len(s["action"]) for t in trajs for s in t)
    assert len(pack_micro_batches(trajs, 1)) == len(trajs)  # over budget: one trajectory each


def test_te_spec_name_mapping_round_trips():
    from megatron_bridge.weights import from_te_names, to_te_names

    sd = {
        "decoder.layers.3.input_layernorm.weight": 1,
        "decoder.layers.3.pre_mlp_layernorm.weight": 2,
        "decoder.final_layernorm.weight": 3,
    }
    te = to_te_names(sd)
    assert te == {
        "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight": 1,
        "decoder.layers.3.mlp.linear_fc1.layer_norm_weight": 2,
        "decoder.final_layernorm.weight": 3,
    }
    assert from_te_names(te) == sd
