import json
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from agent_r1.engines.embedded.engine import Engine
from agent_r1.http_service import BadRequest


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    e = Engine(tiny_model_dir, max_running=8, max_len=512, prefill_chunk=64).start()
    yield e
    e.stop()


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64).eval()


def _prompt(codec, text):
    return codec.encode_chat([{"role": "user", "content": text}])


def _ref_logprobs(hf, prompt, out, temperature):
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([prompt + out])).logits[0]
    logp = torch.log_softmax(logits / (temperature or 1.0), -1)
    return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(out)]


def test_greedy_equals_transformers_and_logprobs_match_float64(engine, hf, codec, tiny_model_dir):
    prompt = _prompt(codec, "Ava has 3 apples. Then Ava finds 4 more apples.")
    (r,) = engine.generate_sync(
        prompt, {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}, return_logprob=True
    )
    m32 = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ref = m32.generate(
        torch.tensor([prompt]), max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    assert r.out_ids == ref[0, len(prompt) :].tolist()
    lp = _ref_logprobs(hf, prompt, r.out_ids, 0)
    assert max(abs(a - b) for a, b in zip(r.out_logprobs, lp, strict=True)) < 1e-5


def test_sampled_logprobs_are_tempered_untruncated(engine, hf, codec):
    prompt = _prompt(codec, "Ben has 7 coins.")
    s = {
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": 20,
        "min_p": 0.01,
        "max_new_tokens": 24,
        "sampling_seed": 5,
        "ignore_eos": True,
    }
    (r,) = engine.generate_sync(prompt, s, return_logprob=True)
    lp = _ref_logprobs(hf, prompt, r.out_ids, 0.7)
    assert max(abs(a - b) for a, b in zip(r.out_logprobs, lp, strict=True)) < 1e-5
    (again,) = engine.generate_sync(prompt, s)
    assert again.out_ids == r.out_ids  # seeded: reproducible
    other = engine.generate_sync(prompt, {**s, "sampling_seed": 6})[0]
    assert other.out_ids != r.out_ids


def test_continuous_batching_matches_one_at_a_time(engine, codec):
    prompts = [_prompt(codec, f"Problem {i}: Cara has {i * 7} beads." + " more" * i) for i in range(12)]
    solo = [
        engine.generate_sync(p, {"temperature": 0, "max_new_tokens": 5 + 3 * i, "ignore_eos": True})[
            0
        ].out_ids
        for i, p in enumerate(prompts)
    ]
    results: list = [None] * len(prompts)

    def run(i):
        results[i] = engine.generate_sync(
            prompts[i], {"temperature": 0, "max_new_tokens": 5 + 3 * i, "ignore_eos": True}
        )[0].out_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]  # 12 requests > 8 slots
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == solo


def test_group_shares_the_prompt_prefill(engine, codec):
    # under the engine lock: a finished request's KV is cached at the end of its scheduler step,
    # which may still be running when the previous call returned
    assert engine.flush_cache()
    prompt = _prompt(
        codec, "Dev has 40 stamps. Then Dev gives away 12 stamps. How many stamps does Dev have now?"
    )
    before, cascade = engine.stats["prefill_tokens"], engine.stats["shared_prefix_steps"]
    reqs = engine.generate_sync(
        prompt, {"temperature": 1.0, "max_new_tokens": 8, "n": 4, "sampling_seed": 1, "ignore_eos": True}
    )
    prefilled = engine.stats["prefill_tokens"] - before
    # once, not 4 times: the siblings fork from the first one's KV and next-token logits
    assert prefilled == len(prompt)
    assert sorted(r.cached_tokens for r in reqs) == [0] + [len(prompt)] * 3
    assert len({tuple(r.out_ids) for r in reqs}) > 1
    assert engine.stats["shared_prefix_steps"] > cascade
    # the group decodes attending over its shared prompt once (cascade attention); each sample
    # equals the same seeded sample run alone, tokens and logprobs
    for i, r in enumerate(reqs):
        (alone,) = engine.generate_sync(
            prompt,
            {"temperature": 1.0, "max_new_tokens": 8, "sampling_seed": 1 + i, "ignore_eos": True},
            return_logprob=True,
        )
        assert alone.out_ids == r.out_ids
        np.testing.assert_allclose(alone.out_logprobs, r.out_logprobs, atol=1e-5)
    # a later step extending prompt + output reuses the cached prefix
    nxt = prompt + reqs[0].out_ids + codec.encode("\n")
    (r2,) = engine.generate_sync(nxt, {"temperature": 0, "max_new_tokens": 2})
    assert r2.cached_tokens >= len(prompt) + len(reqs[0].out_ids) - 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepacked_linear_equals_f_linear(dtype):
    from agent_r1.engines.embedded.slot_model import Linear, _onednn

    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(1024, 256, generator=g).to(dtype), torch.randn(1024, generator=g).to(dtype)
    lin = Linear(w, b)
    # oneDNN packs bf16 weights only on CPUs with AVX-512 (or AVX-NE-CONVERT); elsewhere the probe
    # refuses and the layer falls back to F.linear (checked for equality below all the same)
    supported = dtype == torch.float32 or torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    if torch.backends.mkldnn.is_available() and supported:
        assert _onednn(dtype) and lin.packed is not None  # the fast path is the one in use here
    assert Linear(w[:64, :64]).packed is None  # small weights stay on F.linear
    for rows in (1, 7, 300):
        x = torch.randn(rows, 256, generator=g).to(dtype)
        ref = torch.nn.functional.linear(x.double(), w.double(), b.double())  # outputs of size ~16
        tol = 1e-4 if dtype == torch.float32 else 0.25
        torch.testing.assert_close(lin(x).double(), ref, rtol=0, atol=tol)


def test_cascade_attention_equals_per_slot_attention(tiny_model_dir):
    """Groups of slots with equal KV prefixes of different lengths (leaders anywhere, a singleton):
    decoding with the shared-prefix plan gives the logits of plain per-slot attention."""
    from agent_r1.engines.embedded.slot_model import SlotModel

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    sm = SlotModel(model, slots=10, max_len=96)
    g = torch.Generator().manual_seed(0)
    sm.k.copy_(torch.randn(sm.k.shape, generator=g))
    sm.v.copy_(torch.randn(sm.v.shape, generator=g))
    shared = [(20, [3, 0, 5]), (25, [1, 2, 7, 9]), (20, [4]), (30, [8, 6])]
    for p, slots in shared:
        for s in slots[1:]:
            sm.copy_slot(slots[0], s, p)
    pos = torch.tensor([40, 27, 60, 33, 30, 21, 50, 26, 31, 70])  # each >= its group's prefix
    ids = torch.randint(0, model.config.vocab_size, (10,), generator=g)
    k0, v0 = sm.k.clone(), sm.v.clone()
    plain = sm.decode(ids, pos)
    sm.k.copy_(k0)
    sm.v.copy_(v0)
    cascade = sm.decode(ids, pos, shared)
    torch.testing.assert_close(cascade, plain, rtol=1e-5, atol=1e-5)
    # and it is not the same as ignoring the prefix: the plan is really used
    sm.k.copy_(k0)
    sm.v.copy_(v0)
    sm.k[:, 3, :, :20] = 0.0  # the leader of the first group: its prefix is what slots 0 and 5 read
    assert not torch.allclose(sm.decode(ids, pos, shared)[0], plain[0], atol=1e-3)


@pytest.mark.parametrize("cascade", [False, True])
def test_native_decode_equals_the_pytorch_path(tiny_model_dir, cascade):
    """On a CPU decode runs through the native kernels (attention in place over the cache; q/k
    norms, rotation and cache writes in one pass); its logits are those of the PyTorch path
    (float32 tightly, bf16 within its rounding), and bf16 stays within bf16 rounding of float32
    over the same cache. The tiny model is a Qwen3: the q/k norms are exercised too."""
    from agent_r1.engines.embedded import attention
    from agent_r1.engines.embedded.slot_model import SlotModel

    assert attention._native(torch.float32) and attention._native(torch.bfloat16)  # g++ is installed
    g = torch.Generator().manual_seed(1)
    pos = torch.tensor([30, 17, 44, 25])
    ids = torch.randint(0, 100, (4,), generator=g)
    shared = [(12, [0, 2]), (10, [1, 3])] if cascade else None
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype).eval()
        sm = SlotModel(model, slots=4, max_len=64)
        g.manual_seed(2)
        k, v = torch.randn(sm.k.shape, generator=g), torch.randn(sm.v.shape, generator=g)
        for native in (True, False):
            sm.k.copy_(k)
            sm.v.copy_(v)
            if cascade:
                for p, slots in shared:
                    sm.copy_slot(slots[0], slots[1], p)
            sm.native = native
            out[dtype, native] = sm.decode(ids, pos, shared)
    torch.testing.assert_close(out[torch.float32, True], out[torch.float32, False], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[torch.bfloat16, True], out[torch.bfloat16, False], rtol=0, atol=2e-2)
    ref = out[torch.float32, True]
    assert (out[torch.bfloat16, True] - ref).abs().max() < 0.05 * ref.abs().max()


def test_native_prefill_equals_the_pytorch_path(tiny_model_dir):
    """Prefill on a CPU runs the native kernels too (every token's norms, rotation and cache rows
    in one pass; each token a row of the decode attention kernel over its slot's positions
    0..pos; the glue between the matmuls): the last tokens' logits and the whole KV cache are
    those of the PyTorch path (masked SDPA per request), for requests starting at 0 and ones
    continuing a cached prefix, in float32 tightly and in bf16 within its rounding."""
    from agent_r1.engines.embedded.slot_model import SlotModel

    g = torch.Generator().manual_seed(4)
    items = [(0, 9, 0), (2, 5, 0), (1, 6, 7), (3, 1, 20)]  # (slot, tokens, start)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype).eval()
        sm = SlotModel(model, slots=4, max_len=64)
        k0, v0 = torch.randn(sm.k.shape, generator=g), torch.randn(sm.v.shape, generator=g)
        batch = [(slot, torch.randint(0, 100, (n,), generator=g).tolist(), start) for slot, n, start in items]
        out = {}
        for native in (True, False):
            sm.k.copy_(k0)
            sm.v.copy_(v0)
            sm.native = native
            out[native] = sm.prefill_many(batch), sm.k.clone(), sm.v.clone()
        for a, b in zip(out[True], out[False], strict=True):
            torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)
        assert not torch.equal(out[True][1], k0.to(dtype))  # the cache was written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_glue_kernels_round_as_hf_does(dtype):
    """The native residual add + RMSNorm and SwiGLU product against HF's own modules in the
    model's dtype (Llama's RMSNorm: float32, back to the dtype, times the weight; its MLP's
    silu(gate) * up): in bf16 equal but for a rare last-bit flip (a sum's order, exp's last ulp
    in float32 before the rounding), in float32 within a few ulps."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from agent_r1.engines.embedded.slot_model import _Glue

    g = torch.Generator().manual_seed(5)
    glue = _Glue.get(dtype, True)
    assert glue.add_norm is not None and glue.silu_mul is not None  # g++ is installed
    x, y = (torch.randn(33, 576, generator=g).to(dtype) for _ in range(2))
    norm = LlamaRMSNorm(576, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(576, generator=g) + 0.5)
    want_x = x + y
    want = norm(want_x)
    got_x, got = glue.norm(x.clone(), norm.weight, 1e-5, add=y)
    assert torch.equal(got_x, want_x)  # the residual stream, rounded as the dtype adds
    gu = torch.randn(33, 2 * 1536, generator=g).to(dtype) * 4
    gate, up = gu.chunk(2, -1)
    for a, b in ((got, want), (glue.swiglu(gu), F.silu(gate) * up)):
        ulp = 2e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(a, b, rtol=ulp, atol=ulp)
        assert dtype == torch.float32 or (a == b).float().mean() > 0.99
    _, first = glue.norm(x.clone(), norm.weight, 1e-5)  # no residual: the first layer's norm
    torch.testing.assert_close(first, norm(x), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D,R", [(8, 3), (64, 3), (64, 9), (128, 2)])
def test_attend_against_a_float64_softmax_over_cache_slots(dtype, D, R):
    """Both attention paths against softmax(q K^T s) V in float64 over each row's range of its own
    slot (ranges that start late, a one-position range, ranges not a multiple of 16 long, rows
    reading other rows' slots, a strided query view), and an empty range: output 0, log-sum-exp
    -inf. The kernel's paths: any head size (D 8), 64 and 128 with few queries per row, and many
    (R 9: a shared prompt's group)."""
    from agent_r1.engines.embedded.attention import Span, attend

    g = torch.Generator().manual_seed(3)
    K, V = (torch.randn(6, 2, 40, D, generator=g).to(dtype) for _ in range(2))  # (slots, kv, max_len, D)
    q = torch.randn(5, 2, R + 2, D, generator=g).to(dtype)[:, :, 1 : R + 1]  # R queries per kv head, strided
    lo, hi = torch.tensor([0, 3, 0, 10, 4]), torch.tensor([17, 4, 9, 33, 12])
    slots = torch.tensor([5, 0, 2, 2, 1])
    scale = D**-0.5
    ref_o, ref_lse = [], []
    for n in range(5):
        k, v = K[slots[n], :, lo[n] : hi[n]].double(), V[slots[n], :, lo[n] : hi[n]].double()
        s = (q[n].double() @ k.transpose(-1, -2)) * scale
        ref_o.append(torch.softmax(s, -1) @ v)
        ref_lse.append(torch.logsumexp(s, -1))
    ref_o, ref_lse = torch.stack(ref_o), torch.stack(ref_lse)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=2e-2)
    for native in (True, False):
        o, lse = attend(q, K, V, Span(lo, hi, slots), scale, native)
        assert o.dtype == dtype and lse.dtype == torch.float32
        torch.testing.assert_close(o.double(), ref_o, **tol)
        torch.testing.assert_close(lse.double(), ref_lse, **tol)  # bf16 matmuls round the scores
    o, lse = attend(q[:2], K, V, Span(torch.tensor([0, 5]), torch.tensor([4, 5])), scale)
    assert torch.isneginf(lse[1]).all() and (o[1] == 0).all() and torch.isfinite(lse[0]).all()


def test_stop_rules(engine, codec, tokenizer):
    prompt = _prompt(codec, "hello")
    (base,) = engine.generate_sync(prompt, {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True})
    stop_tok = base.out_ids[3]
    first = base.out_ids.index(stop_tok)
    (r,) = engine.generate_sync(
        prompt, {"temperature": 0, "max_new_tokens": 12, "stop_token_ids": [stop_tok]}
    )
    assert r.out_ids == base.out_ids[: first + 1] and r.finish == {"type": "stop", "matched": stop_tok}
    (r,) = engine.generate_sync(
        prompt,
        {"temperature": 0, "max_new_tokens": 12, "stop_token_ids": [stop_tok], "min_new_tokens": first + 2},
    )
    assert len(r.out_ids) >= first + 2 and stop_tok not in r.out_ids[: first + 2]
    text = tokenizer.decode(base.out_ids)
    needle = text[len(text) // 2 : len(text) // 2 + 2]
    (r,) = engine.generate_sync(
        prompt, {"temperature": 0, "max_new_tokens": 12, "stop": [needle], "ignore_eos": True}
    )
    assert r.finish == {"type": "stop", "matched": needle} and needle in tokenizer.decode(r.out_ids)
    (r,) = engine.generate_sync(prompt, {"temperature": 0, "max_new_tokens": 7, "ignore_eos": True})
    assert r.finish == {"type": "length", "length": 7}


def _freeze_at(engine, req, n: int) -> tuple[threading.Event, threading.Event]:
    """Freeze ``engine`` once ``req`` has ``n`` tokens: its callback runs in the scheduler thread
    (the lock held) and marks the engine paused in place, so the scheduler takes no further step
    until ``resume`` (no race with a request that could finish between two polls of a busy
    machine). Returns (frozen, finished) events."""
    frozen = threading.Event()

    def on_update(r, finished: bool) -> None:
        if len(r.out_ids) == n and not finished and not frozen.is_set():
            engine.paused = "in_place"  # what pause("in_place") sets, from inside the step
            frozen.set()
        if finished:
            done.set()

    done = threading.Event()
    req.on_update = on_update
    return frozen, done


def test_abort_returns_partial(engine, codec):
    reqs = engine.make_requests(
        _prompt(codec, "long one"), {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True}, rid="long"
    )
    frozen, done = _freeze_at(engine, reqs[0], 3)
    engine.submit(reqs)
    try:
        assert frozen.wait(60)
        engine.abort("long")
    finally:  # the module's engine serves the later tests
        engine.resume()
    assert done.wait(60)
    r = reqs[0]
    assert r.finish["type"] == "abort" and len(r.out_ids) == 3 and len(r.out_logprobs) == 3


def test_a_batch_is_aborted_in_one_pass_and_nothing_else(engine, codec):
    """``abort(rids=...)``: a client's whole batch (a hung-up /generate of thousands of sequences)
    in one pass over the queues; requests of other clients are untouched."""
    finished = threading.Semaphore(0)
    engine.pause("in_place")
    try:
        reqs = [
            r
            for name in ("a", "b", "c")
            for r in engine.make_requests(
                _prompt(codec, name), {"max_new_tokens": 4, "n": 2, "ignore_eos": True}, rid=name
            )
        ]
        for r in reqs:
            r.on_update = lambda r, f: f and finished.release()
        engine.submit(reqs)
        kept = [r for r in reqs if r.rid.startswith("b")]
        assert engine.abort(rids=[r.rid for r in reqs if r not in kept]) == 4
        assert sorted(r.rid for r in engine.waiting) == sorted(r.rid for r in kept)
    finally:
        engine.resume()
    for _ in reqs:
        assert finished.acquire(timeout=60)
    for r in reqs:
        if r in kept:
            assert r.finish["type"] == "length" and len(r.out_ids) == 4
        else:
            assert r.finish["type"] == "abort" and r.out_ids == []


def test_pause_retract_continue(engine, codec):
    prompt = _prompt(codec, "retract me")
    (ref,) = engine.generate_sync(prompt, {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True})
    reqs = engine.make_requests(prompt, {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True})
    frozen, done = _freeze_at(engine, reqs[0], 5)
    engine.submit(reqs)
    try:
        assert frozen.wait(60)
        engine.pause("retract")  # from in place to retract: its KV goes, its tokens stay
        assert reqs[0].finish is None and len(reqs[0].out_ids) == 5
        assert not engine.running and reqs[0].state == "waiting"  # frozen, KV dropped
    finally:  # the module's engine serves the later tests
        engine.resume()
    assert done.wait(60)
    assert reqs[0].out_ids == ref.out_ids and reqs[0].retractions == 1  # recomputed, same greedy output


def test_weight_update_changes_outputs_and_version(tiny_model_dir, codec):
    e = Engine(tiny_model_dir, max_running=2, max_len=256).start()
    try:
        prompt = _prompt(codec, "x")
        (a,) = e.generate_sync(prompt, {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True})
        w = dict(e.model.named_parameters())["model.layers.0.mlp.down_proj.weight"]
        g = torch.Generator().manual_seed(0)
        new = {
            "model.layers.0.mlp.down_proj.weight": torch.randn(w.shape, generator=g) * 0.5,
            "lm_head.weight": torch.randn(e.model.lm_head.weight.shape, generator=g)
            * 0.05,  # tied: the embedding too
        }
        e.update_weights(new, version="7")
        (b,) = e.generate_sync(
            prompt, {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}, return_logprob=True
        )
        assert (b.out_ids, b.out_logprobs) != (a.out_ids, a.out_logprobs) and b.weight_version == "7"
        assert torch.equal(e.model.model.embed_tokens.weight, new["lm_head.weight"])
        with pytest.raises(BadRequest, match="unknown parameter 'nope'"):
            e.update_weights({"nope": torch.zeros(1)})
        with pytest.raises(BadRequest, match="shapes"):
            e.update_weights({"model.norm.weight": torch.zeros(3)})
    finally:
        e.stop()


def test_moe_experts_update_by_their_checkpoint_names(tmp_path):
    """A push names each expert's projections as the checkpoint does (HF keeps them stacked):
    each lands in its expert's slice of the stacked tensor, and the next answer changes."""
    from agent_r1.engines.embedded.engine import checkpoint_tensors
    from agent_r1.models.tiny import build_tiny_model
    from recipes import load_recipe

    d = build_tiny_model(tmp_path / "moe", load_recipe("arithmetic_tool").corpus(num=100), arch="qwen3_moe", vocab_size=400)  # fmt: skip
    e = Engine(d, max_running=2, max_len=128).start()
    try:
        greedy = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
        (a,) = e.generate_sync([1, 5, 9, 14], greedy, return_logprob=True)
        names = checkpoint_tensors(e.model)
        assert "model.layers.1.mlp.experts.7.up_proj.weight" in names
        assert not [n for n in names if n.endswith(("gate_up_proj", "experts.down_proj"))]
        g = torch.Generator().manual_seed(0)
        new = {
            f"model.layers.{i}.mlp.experts.{x}.{p}_proj.weight": torch.randn(names[f"model.layers.{i}.mlp.experts.{x}.{p}_proj.weight"].shape, generator=g)
            for i in range(2) for x in range(8) for p in ("gate", "up", "down")
        }  # fmt: skip
        e.update_weights(new, version="2")
        stacked = e.model.model.layers[0].mlp.experts
        inter = stacked.gate_up_proj.shape[1] // 2
        assert torch.equal(
            stacked.gate_up_proj[3, inter:], new["model.layers.0.mlp.experts.3.up_proj.weight"]
        )
        assert torch.equal(stacked.down_proj[5], new["model.layers.0.mlp.experts.5.down_proj.weight"])
        (b,) = e.generate_sync([1, 5, 9, 14], greedy, return_logprob=True)
        assert b.out_logprobs != a.out_logprobs and b.weight_version == "2"
    finally:
        e.stop()


@pytest.mark.parametrize(
    "prompt,sampling,msg",
    [
        ([], {}, "input_ids: must be a non-empty"),
        ([10**7], {}, "outside the vocabulary"),
        (list(range(1, 600)), {}, "does not fit the context length"),
        ([1], {"temperatur": 1}, "unknown field `temperatur`"),
        ([1], {"top_p": 0}, "sampling_params.top_p"),
        ([1], {"max_new_tokens": -1}, "sampling_params.max_new_tokens"),
        ([1], {"n": 0}, "sampling_params.n"),
        ([1], {"stop_token_ids": [-1]}, "sampling_params.stop_token_ids"),
        ([1], {"stop": ""}, "sampling_params.stop"),
    ],
)
def test_bad_requests_name_the_field(engine, prompt, sampling, msg):
    with pytest.raises(BadRequest, match=msg):
        engine.make_requests(prompt, sampling)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3_moe"])
def test_other_architectures_match_transformers(tmp_path, arch, codec):
    from agent_r1.models.tiny import build_tiny_model
    from recipes import load_recipe

    d = build_tiny_model(
        tmp_path / arch,
        load_recipe("arithmetic_tool").corpus(num=100),
        arch=arch,
        vocab_size=400,
        hidden=48,
        layers=2,
        heads=4,
        kv_heads=2,
    )
    e = Engine(d, max_running=4, max_len=256).start()
    try:
        prompt = [1, 5, 9, 14, 30, 2, 7]
        (r,) = e.generate_sync(
            prompt, {"temperature": 0, "max_new_tokens": 20, "ignore_eos": True}, return_logprob=True
        )
        eager = {"experts_implementation": "eager"} if arch == "qwen3_moe" else {}  # float64 experts
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64, **eager).eval()
        with torch.no_grad():
            ids = torch.tensor([prompt])
            for _ in range(20):
                ids = torch.cat([ids, hf(input_ids=ids).logits[0, -1].argmax().view(1, 1)], 1)
        assert r.out_ids == ids[0, len(prompt) :].tolist()
        assert (
            max(
                abs(a - b)
                for a, b in zip(r.out_logprobs, _ref_logprobs(hf, prompt, r.out_ids, 0), strict=True)
            )
            < 1e-5
        )
    finally:
        e.stop()


def test_bfloat16_engine(tiny_model_dir):
    e = Engine(tiny_model_dir, dtype="bfloat16", max_running=2, max_len=128).start()
    try:
        (r,) = e.generate_sync(
            [1, 2, 3],
            {"temperature": 1.0, "max_new_tokens": 10, "ignore_eos": True, "sampling_seed": 0},
            return_logprob=True,
        )
        assert len(r.out_ids) == 10 and all(lp <= 0 and lp == lp for lp in r.out_logprobs)
        assert e.sm.k.dtype == torch.bfloat16
    finally:
        e.stop()
    with pytest.raises(ValueError, match="dtype"):
        Engine(tiny_model_dir, dtype="float8")


def test_a_cpu_engine_reuses_freed_host_blocks(tiny_model_dir):
    """A CPU engine keeps large freed blocks (``cpus.keep_freed_blocks``): a step's logits and
    activations, freed and allocated again, cost no page faults once the heap has settled (glibc's
    default hands every block over its mmap threshold back to the kernel, to be zero-filled again
    at the next step)."""
    code = f"""
import json, resource, torch
from agent_r1.engines.embedded.engine import Engine
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def step():
    before = faults()
    x = torch.ones(64 << 20, dtype=torch.uint8); del x
    return faults() - before
plain = [step() for _ in range(12)]
Engine({str(tiny_model_dir)!r}, max_running=2, max_len=64)
print(json.dumps([plain, [step() for _ in range(12)]]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    plain, kept = json.loads(out.stdout.strip().splitlines()[-1])
    assert min(plain[6:]) > 10_000, plain  # 64 MB of fresh pages (4 KB each) at every step before
    assert sum(kept[6:]) < 16_384, kept  # after: at most one step's worth while the heap settles


def test_the_kv_cache_is_zeroed_aligned_and_writable_memory():
    """``cache_zeros``: the KV cache's own allocation (huge-page advised anonymous memory on a
    Linux CPU) is a contiguous zero tensor of the shape and dtype asked, 2 MiB-aligned there,
    writable, and stays valid after the call returns (its mapping lives as long as a view)."""
    import gc
    import mmap

    from agent_r1.engines.embedded.slot_model import cache_zeros

    shape = (2, 3, 2, 512, 64)  # 786,432 values: 1.5 MiB in bf16 (torch.zeros), 3 MiB in float32 (mapped)
    for dtype in (torch.bfloat16, torch.float32):
        t = cache_zeros(shape, dtype, torch.device("cpu"))
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
        assert not t.any()
        if hasattr(mmap, "MADV_HUGEPAGE") and t.numel() * t.element_size() >= 2 << 20:
            assert t.data_ptr() % (2 << 20) == 0
        view = t[1, 2]
        del t
        gc.collect()
        view.fill_(3)
        assert float(view.float().sum()) == 3 * view.numel()
    small = cache_zeros((4, 8), torch.float32, torch.device("cpu"))  # under 2 MiB: torch.zeros
    assert small.shape == (4, 8) and not small.any()
