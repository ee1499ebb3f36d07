"""The CPU learner's SwiGLU (``agent_r1.learner.backend.activation``): the native forward and backward."""

import pytest
import torch
import torch.nn.functional as F


def _grads(fn, x_in, dy):
    x = x_in.clone().requires_grad_(True)
    y = fn(x)
    y.backward(dy.to(y.dtype))
    return y.detach(), x.grad


def _unfused(x):  # Megatron's glu
    a, b = torch.chunk(x, 2, dim=-1)
    return F.silu(a) * b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_swiglu_matches_float64_autograd(dtype):
    """Output and input gradient of ``swiglu`` on an (s, b, 2I) input against float64 autograd of
    silu(a) * b: within float32 rounding, or a bf16 rounding, and no worse than PyTorch's unfused
    ops; in bf16 it rounds where they round, so all but a few values are equal to theirs."""
    from agent_r1.learner.backend.activation import _kernels, swiglu

    assert _kernels(dtype) is not None
    g = torch.Generator().manual_seed(0)
    x0 = (torch.randn(53, 2, 2 * 40, generator=g) * 3).to(dtype)
    dy = torch.randn(53, 2, 40, generator=g).to(dtype)
    want = _grads(_unfused, x0.double(), dy.double())
    plain = _grads(_unfused, x0, dy)
    got = _grads(swiglu, x0, dy)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    for name, a, b, p in zip(("y", "dx"), got, want, plain, strict=True):
        assert a.dtype == dtype and a.shape == p.shape, name
        err = ((a.double() - b).abs().max() / b.abs().max()).item()
        err_plain = ((p.double() - b).abs().max() / b.abs().max()).item()
        assert err < tol, (name, err)
        assert err <= max(2 * err_plain, 1e-7), (name, err, err_plain)
        if dtype == torch.bfloat16:
            assert (a != p).float().mean() < 0.01, name
    with torch.no_grad():  # no graph: the forward alone, the same values
        torch.testing.assert_close(swiglu(x0), got[0], rtol=0, atol=0)


def test_a_cpu_learners_dry_run_keeps_what_the_native_function_keeps():
    """On meta tensors (a dry run of a CPU learner) the routed activation keeps what the native
    Function keeps (its backward node), so the plan counts what a CPU learner holds. (A plan of a
    GPU's kernels never routes it in: ``packed_forward``'s ``fused_plan``, the GPU presets' plans.)"""
    from agent_r1.learner.backend.activation import swiglu

    x = torch.empty(4, 1, 16, device="meta", requires_grad=True)
    y = swiglu(x)
    assert y.shape == (4, 1, 8) and type(y.grad_fn).__name__ == "_SwiGLUBackward"


def test_only_plain_swiglu_configs_are_routed():
    """``_plain_swiglu``: a gated SiLU MLP without a clamp or an offset, that Megatron would run
    unfused; anything else keeps Megatron's own activation path."""
    from types import SimpleNamespace

    from agent_r1.learner.backend.activation import _plain_swiglu

    base = dict(
        gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=False,
        use_te_activation_func=False, activation_func_clamp_value=None, glu_linear_offset=0.0,
    )  # fmt: skip
    assert _plain_swiglu(SimpleNamespace(**base))
    for key, value in [
        ("gated_linear_unit", False), ("activation_func", F.gelu), ("bias_activation_fusion", True),
        ("use_te_activation_func", True), ("activation_func_clamp_value", 7.0), ("glu_linear_offset", 1.0),
    ]:  # fmt: skip
        assert not _plain_swiglu(SimpleNamespace(**{**base, key: value})), key
