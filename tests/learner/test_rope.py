"""The CPU learner's rotary embedding (``agent_r1.learner.backend.rope``): the native forward and backward."""

import pytest
import torch


def _angles(S, rot, g):
    pos = torch.randint(0, 500, (S,), generator=g).double()
    inv = 1.0 / 10000 ** (torch.arange(0, rot, 2).double() / rot)
    f = torch.outer(pos, inv)
    return torch.cat((f, f), dim=-1)[:, None, None, :]  # (S, 1, 1, rot), as PackedRotary gives them


def _grads(fn, t_in, dy):
    t = t_in.clone().requires_grad_(True)
    y = fn(t)
    y.backward(dy)
    return y.detach(), t.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rot", [16, 10])  # every dimension rotated, or a pass-through part
def test_native_rope_matches_float64_and_megatrons_unfused_rope(dtype, rot):
    """Output and gradient of ``fused_rope`` on (s, b, heads, d) against the rotate_half formula in
    float64: within float32 rounding; in bf16 equal to Megatron's unfused function, value for value
    (the kernel rounds each product and the sum where PyTorch's ops round them)."""
    from megatron.core.models.common.embeddings import rope_utils

    from agent_r1.learner.backend.rope import _kernel, fused_rope

    assert _kernel(dtype) is not None
    g = torch.Generator().manual_seed(0)
    S, d = 41, 16
    freqs = _angles(S, rot, g).float().double()  # the float32 angles the model passes
    t0 = torch.randn(S, 2, 3, d, generator=g, dtype=torch.float64)
    dy = torch.randn(S, 2, 3, d, generator=g, dtype=torch.float64)

    def formula(t):  # y = t cos + rotate_half(t) sin on the first rot dimensions, the rest as it is
        r, rest = t[..., :rot], t[..., rot:]
        a, b = r.chunk(2, dim=-1)
        return torch.cat((r * freqs.cos() + torch.cat((-b, a), -1) * freqs.sin(), rest), -1)

    want = _grads(formula, t0, dy)
    got = _grads(lambda t: fused_rope(t, freqs.float()), t0.to(dtype), dy.to(dtype))
    megatron = _grads(
        lambda t: rope_utils._apply_rotary_pos_emb_bshd(t, freqs.float()), t0.to(dtype), dy.to(dtype)
    )
    for name, a, b, m in zip(("y", "dt"), got, want, megatron, strict=True):
        assert a.dtype == dtype and a.shape == b.shape, name
        if dtype == torch.float32:
            torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)
        else:
            torch.testing.assert_close(a, m, rtol=0, atol=0)
            torch.testing.assert_close(a.double(), b, rtol=2e-2, atol=2e-2)
    with torch.no_grad():  # no graph: the forward alone, the same values
        torch.testing.assert_close(fused_rope(t0.to(dtype), freqs.float()), got[0], rtol=0, atol=0)


def test_what_the_kernel_does_not_cover_takes_megatrons_unfused_rope():
    """Interleaved pairs and angles per batch row are Megatron's unfused function's, exactly."""
    from megatron.core.models.common.embeddings import rope_utils

    from agent_r1.learner.backend.rope import fused_rope

    g = torch.Generator().manual_seed(1)
    t = torch.randn(9, 2, 3, 8, generator=g)
    freqs = _angles(9, 8, g).float()
    for f, interleaved in ((freqs, True), (freqs.expand(9, 2, 1, 8), False)):
        want = rope_utils._apply_rotary_pos_emb_bshd(t, f, rotary_interleaved=interleaved)
        torch.testing.assert_close(fused_rope(t, f, interleaved=interleaved), want, rtol=0, atol=0)


def test_a_cpu_learners_dry_run_keeps_what_the_native_function_keeps():
    """On meta tensors (a dry run of a CPU learner) the routed rotary embedding keeps what the
    native Function keeps (its backward node); interleaved pairs take Megatron's unfused function.
    (A plan of a GPU's kernels never routes it in: ``packed_forward``'s ``fused_plan``.)"""
    from agent_r1.learner.backend.rope import fused_rope

    t = torch.empty(5, 1, 3, 8, device="meta", requires_grad=True)
    freqs = torch.empty(5, 1, 1, 8, device="meta")
    y = fused_rope(t, freqs)
    assert y.shape == t.shape and type(y.grad_fn).__name__ == "_RopeBackward"
    y = fused_rope(t, freqs, interleaved=True)
    assert y.shape == t.shape and type(y.grad_fn).__name__ != "_RopeBackward"
