import asyncio

import torch
from transformers import AutoModelForCausalLM

from agent_r1.engines.hf import HFGenerator
from agent_r1.rollout.protocol import FinishReason, SamplingParams


def _teacher_forced_logprobs(model, prompt, out, temperature):
    ids = torch.tensor([prompt + out])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()
    logits = logits / temperature if temperature > 0 else logits
    logp = torch.log_softmax(logits, -1)
    return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(out)]


def test_greedy_matches_full_forward(tiny_model_dir, codec):
    gen = HFGenerator(tiny_model_dir)
    prompt = codec.encode_chat([{"role": "user", "content": "Ava has 3 apples."}])
    out = asyncio.run(gen(prompt, SamplingParams(temperature=0, max_new_tokens=12)))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        ids = torch.tensor([prompt])
        greedy = []
        for _ in range(len(out.token_ids)):  # independent: full recompute, no KV cache
            nxt = int(model(input_ids=ids).logits[0, -1].argmax())
            greedy.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
    assert out.token_ids == greedy
    ref = _teacher_forced_logprobs(model, prompt, out.token_ids, 0)
    assert max(abs(a - b) for a, b in zip(out.logprobs, ref, strict=True)) < 1e-4
    assert out.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)


def test_sampling_seeded_and_logprobs_are_tempered(tiny_model_dir, codec):
    gen = HFGenerator(tiny_model_dir, policy_version=5)
    prompt = codec.encode_chat([{"role": "user", "content": "Ben has 7 coins."}])
    s = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=16, seed=123)
    a = asyncio.run(gen(prompt, s))
    b = asyncio.run(gen(prompt, s))
    assert a.token_ids == b.token_ids and a.policy_version == 5
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ref = _teacher_forced_logprobs(model, prompt, a.token_ids, 0.7)
    assert max(abs(x - y) for x, y in zip(a.logprobs, ref, strict=True)) < 1e-4


def test_stop_token_ends_generation(tiny_model_dir, codec):
    gen = HFGenerator(tiny_model_dir)
    prompt = codec.encode_chat([{"role": "user", "content": "hi"}])
    first = asyncio.run(gen(prompt, SamplingParams(temperature=0, max_new_tokens=4))).token_ids
    out = asyncio.run(gen(prompt, SamplingParams(temperature=0, max_new_tokens=4, stop_token_ids=[first[1]])))
    cut = first.index(first[1]) + 1
    assert out.token_ids == first[:cut] and out.finish_reason == FinishReason.STOP
