"""Packed, prefix-merged policy logprobs through Megatron at TP1/TP2/PP2 (causal SDPA per packed
sequence) equal per-step recomputation with the HF model; the vocab-parallel logprob/entropy backward equals autograd."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from spawn import spawn_ranks

WORKER = Path(__file__).with_name("megatron_policy_worker.py")


@pytest.fixture(scope="module")
def policy_results(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("policy") / "results.json"
    spawn_ranks(WORKER, 2, tiny_model_dir, out, timeout=600)
    return json.loads(out.read_text())


@pytest.mark.parametrize("layout", ["1x1", "2x1", "1x2"])
def test_prefix_merged_packed_logprobs_equal_per_step(policy_results, layout):
    assert policy_results[layout] < 1e-5
    assert policy_results[f"{layout}_per_sequence_attention"]  # SDPA per packed sequence, no N x N mask
    assert policy_results[f"{layout}_native_swiglu"] > 0  # every MLP's activation: native/swiglu.cpp
    assert policy_results[f"{layout}_native_rope"] > 0  # and the rotary embedding: native/rope.cpp


def test_per_sequence_attention_equals_the_masked_attention(policy_results):
    assert policy_results["sdpa_vs_mask_logits"] < 1e-4


def test_output_layer_on_selected_rows_equals_the_full_projection(policy_results):
    assert policy_results["row_select_vs_all_logits"] < 1e-5


def test_vocab_parallel_backward(policy_results):
    assert policy_results["vocab_parallel_value_diff"] < 1e-6
    assert policy_results["vocab_parallel_grad_diff"] < 1e-6


def test_vocab_parallel_tempered_logprobs_and_grads_equal_full_softmax(policy_results):
    """At the rollout's T = 0.7, in chunks: log_softmax(full / T) of the targets and its entropy,
    values and gradients (which are not trivially small)."""
    assert policy_results["vocab_parallel_tempered_value_diff"] < 1e-6
    assert policy_results["vocab_parallel_tempered_grad_diff"] < 1e-6
    assert policy_results["vocab_parallel_tempered_grad_norm"] > 1e-2


@pytest.mark.parametrize("temp", [0.0, -1.0, float("inf"), float("nan")])
def test_packed_logprobs_refuses_a_temperature_that_is_not_positive_and_finite(temp):
    """A greedy rollout's logprobs are untempered: the learner passes T = 1 for it
    (rollout.protocol.logprob_temperature), never 0."""
    import torch

    from agent_r1.learner.logprobs import packed_logprobs

    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        packed_logprobs(torch.zeros(2, 5), torch.tensor([0, 1]), temperature=temp)


def _bounds(lengths: list[int]) -> tuple[list[tuple[int, int]], int]:
    """Packed sequences of these lengths: their (start, end) and the stream's length."""
    bounds, a = [], 0
    for n in lengths:
        bounds.append((a, a + n))
        a += n
    return bounds, a


def _per_sequence_attention(bounds, q, k, v, scale):
    """Causal SDPA on each packed sequence by itself, (rows, 1, heads * hn) like PackedAttention."""
    outs = []
    for s, e in bounds:
        qs, ks, vs = (x[s:e, 0].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        outs.append(o[0].transpose(0, 1).reshape(e - s, 1, -1))
    return torch.cat(outs)


def test_bucketed_attention_equals_per_sequence_causal_attention_with_gradients():
    """Packed sequences of different lengths batched into padded buckets (``AttentionPlan``) and
    attended with the causal mask alone: outputs and the gradients of q, k and v equal causal
    attention run on each sequence by itself (float64), so the pads (at each sequence's end, the
    first row repeated) leak nothing forward or backward. Grouped-query heads, as SmolLM2."""
    from types import SimpleNamespace

    from agent_r1.learner.attention import AttentionPlan, PackedAttention

    g = torch.Generator().manual_seed(0)
    bounds, a = _bounds([7, 6, 2, 5, 1])
    heads, groups, hn = 4, 2, 8
    q, k, v = (torch.randn(a, 1, h, hn, generator=g, dtype=torch.float64) for h in (heads, groups, groups))
    plan = AttentionPlan.of(bounds, torch.device("cpu"))
    assert any(b.nb > 1 for b in plan.buckets)  # padding really happens
    attn = PackedAttention(SimpleNamespace(softmax_scale=0.3), {"plan": plan})
    grad_out = torch.randn(a, 1, heads * hn, generator=g, dtype=torch.float64)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    (attn(*leaves, None) * grad_out).sum().backward()
    ref_leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    ref = _per_sequence_attention(bounds, *ref_leaves, 0.3)
    (ref * grad_out).sum().backward()
    out = attn(q, k, v, None)
    torch.testing.assert_close(out, ref.detach(), rtol=1e-10, atol=1e-10)
    for got, ref in zip(leaves, ref_leaves, strict=True):
        torch.testing.assert_close(got.grad, ref.grad, rtol=1e-10, atol=1e-10)
    # a bf16 model's attention (computed in float32 on a CPU) comes back in bf16, within its rounding
    low = attn(*(x.bfloat16() for x in (q, k, v)), None)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.double(), out, rtol=0, atol=3e-2)


@pytest.mark.parametrize("max_len", [0, 5, 10_000])
def test_bf16_bucketed_attention_matches_float64_on_either_kernel(max_len, monkeypatch):
    """A bf16 model's packed attention on a CPU: buckets up to ``MATMUL_ATTENTION_MAX_LEN`` run
    as bf16 matmuls, longer ones on the float32 flash kernel (``max_len`` 5 mixes both in one
    plan). Outputs and q/k/v gradients stay within bf16 rounding of float64 causal attention of
    each sequence alone."""
    from types import SimpleNamespace

    from agent_r1.learner import attention
    from agent_r1.learner.attention import AttentionPlan, PackedAttention

    monkeypatch.setattr(attention, "MATMUL_ATTENTION_MAX_LEN", max_len)
    g = torch.Generator().manual_seed(1)
    bounds, a = _bounds([9, 8, 3, 6, 1, 5])
    heads, groups, hn = 6, 2, 16
    q, k, v = (torch.randn(a, 1, h, hn, generator=g, dtype=torch.float64) for h in (heads, groups, groups))
    q, k, v = (x.bfloat16().double() for x in (q, k, v))  # what the bf16 run sees, exactly
    grad_out = torch.randn(a, 1, heads * hn, generator=g, dtype=torch.float64).bfloat16()
    plan = AttentionPlan.of(bounds, torch.device("cpu"))
    attn = PackedAttention(SimpleNamespace(softmax_scale=0.25), {"plan": plan})
    leaves = [x.bfloat16().requires_grad_(True) for x in (q, k, v)]
    out = attn(*leaves, None)
    assert out.dtype == torch.bfloat16
    (out.float() * grad_out.float()).sum().backward()
    ref_leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    ref = _per_sequence_attention(bounds, *ref_leaves, 0.25)
    (ref * grad_out.double()).sum().backward()
    torch.testing.assert_close(out.double(), ref.detach(), rtol=0, atol=3e-2)
    for got, want in zip(leaves, ref_leaves, strict=True):
        assert got.grad.dtype == torch.bfloat16
        err = (got.grad.double() - want.grad).abs().max() / want.grad.abs().max()
        assert err < 3e-2, err


def test_matmul_causal_attention_equals_sdpa_in_float64():
    """The matmul kernel itself, exact arithmetic: grouped-query heads stacked per group, the
    causal -inf and the scale in one baddbmm give SDPA's outputs and gradients (float64)."""
    from agent_r1.learner.attention import matmul_causal_attention

    g = torch.Generator().manual_seed(2)
    nb, L, heads, groups, hn = 3, 7, 6, 2, 4
    q, k, v = (torch.randn(nb, L, h, hn, generator=g, dtype=torch.float64, requires_grad=True)
               for h in (heads, groups, groups))  # fmt: skip
    w = torch.randn(nb, L, heads, hn, generator=g, dtype=torch.float64)
    out = matmul_causal_attention(q, k, v, 0.4)
    (out * w).sum().backward()
    ref_in = [x.detach().transpose(1, 2).requires_grad_(True) for x in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, is_causal=True, scale=0.4, enable_gqa=True).transpose(1, 2)
    (ref * w).sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for got, want in zip((q, k, v), ref_in, strict=True):
        torch.testing.assert_close(got.grad, want.grad.transpose(1, 2), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_native_causal_softmax_matches_float64_sdpa(dtype, monkeypatch):
    """On a CPU the matmul attention's softmax is ``native/causal_softmax.cpp`` (each row over its
    causal columns, the scale inside): outputs and gradients against float64 SDPA within float32
    rounding or a bf16 rounding, and no worse than the baddbmm + softmax path it replaces (a scale
    that is not a power of two, an odd length, grouped-query heads)."""
    from agent_r1.learner import attention

    assert attention._causal_softmax_kernels(dtype) is not None
    g = torch.Generator().manual_seed(3)
    nb, L, heads, groups, hn = 3, 37, 6, 2, 16
    x64 = [torch.randn(nb, L, h, hn, generator=g, dtype=torch.float64) for h in (heads, groups, groups)]
    w = torch.randn(nb, L, heads, hn, generator=g, dtype=torch.float64)
    ref_in = [x.transpose(1, 2).requires_grad_(True) for x in x64]
    ref = F.scaled_dot_product_attention(*ref_in, is_causal=True, scale=0.3, enable_gqa=True).transpose(1, 2)
    (ref * w).sum().backward()
    want = [ref.detach(), *(x.grad.transpose(1, 2) for x in ref_in)]

    def run():
        q, k, v = (x.to(dtype).requires_grad_(True) for x in x64)
        out = attention.matmul_causal_attention(q, k, v, 0.3)
        (out * w.to(dtype)).sum().backward()
        return [out.detach(), q.grad, k.grad, v.grad]

    def errors(got):
        return [((a.double() - b).abs().max() / b.abs().max()).item() for a, b in zip(got, want, strict=True)]

    native = errors(run())
    monkeypatch.setattr(attention, "_causal_softmax_kernels", lambda dtype: None)
    plain = errors(run())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, e, p in zip(("out", "dq", "dk", "dv"), native, plain, strict=True):
        assert e < tol and e <= max(2 * p, 1e-6), (name, e, p)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_native_logprob_kernel_equals_the_pytorch_path(dtype, monkeypatch):
    """On a CPU the vocabulary-parallel logprob/entropy runs as ``native/logprob.cpp``: logprobs,
    entropies and the logits' gradients (from both outputs, and from the logprob alone) are those
    of the PyTorch path (which the Megatron workers check against autograd on the full softmax),
    for a TP rank's slice with padding columns, a temperature, and targets outside the slice."""
    from agent_r1.learner import logprobs

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(37, 100, generator=g) * 4).to(dtype)
    targets = torch.randint(0, 140, (37,), generator=g)  # the slice holds ids 50..149, real up to 139
    start, size, temp = 50, 140, 0.7
    w_lp, w_ent = torch.randn(37, generator=g), torch.randn(37, generator=g)
    assert logprobs._LogprobKernel.of(logits, temp, start, size) is not None

    def run(with_entropy: bool):
        x = logits.clone().requires_grad_(True)
        lp, ent = logprobs.vocab_parallel_logprob_entropy(x, targets, start, None, size, temp)
        ((lp * w_lp).sum() + ((ent * w_ent).sum() if with_entropy else 0)).backward()
        return lp.detach(), ent.detach(), x.grad

    native = [run(True), run(False)]
    monkeypatch.setattr(logprobs._LogprobKernel, "of", classmethod(lambda cls, *a: None))
    ref = [run(True), run(False)]
    for got, want in zip(native, ref, strict=True):
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
        assert got[2].dtype == dtype and (got[2][:, size - start :] == 0).all()  # padding: no gradient
        tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-4)
        torch.testing.assert_close(got[2], want[2], **tol)
