"""The CPU learner's RMSNorm: PyTorch's forward, the native one-pass backward."""

import pytest
import torch


@pytest.mark.parametrize(
    "dtype,wdtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)],
)
def test_fused_rms_norm_gradients_match_float64_autograd(dtype, wdtype):
    """Outputs, input gradients and weight gradients of a routed ``torch.nn.RMSNorm`` (a (s, b, h)
    input, a non-unit weight; bf16 activations with a bf16 weight, or a float32 one as Megatron's
    torch norms keep in a bf16 model) against float64 autograd of the same norm: within float32
    rounding, or one bf16 rounding. And no worse than PyTorch's own path."""
    from agent_r1.learner.backend.norm import install_fused_rms_norm

    g = torch.Generator().manual_seed(0)
    norm = torch.nn.RMSNorm(96, eps=1e-5).to(wdtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(96, generator=g) + 0.5)
    x0 = torch.randn(37, 2, 96, generator=g).to(dtype)
    dy = torch.randn(37, 2, 96, generator=g).to(dtype)

    def grads(module, x_in):
        x = x_in.clone().requires_grad_(True)
        module.zero_grad()
        y = module(x)
        y.backward(dy.to(y.dtype))
        return y.detach(), x.grad, module.weight.grad.clone()

    ref64 = torch.nn.RMSNorm(96, eps=1e-5).double()
    with torch.no_grad():
        ref64.weight.copy_(norm.weight.double())
    want = grads(ref64, x0.double())
    plain = grads(norm, x0)  # PyTorch's backward
    assert install_fused_rms_norm(norm) == 1 and install_fused_rms_norm(norm) == 1
    got = grads(norm, x0)
    tol = 1e-5 if dtype == wdtype == torch.float32 else 1e-2
    for name, a, b, p in zip(("y", "dx", "dw"), got, want, plain, strict=True):
        assert a.dtype == (wdtype if name == "dw" else dtype), name
        err = ((a.double() - b).abs().max() / b.abs().max()).item()
        err_plain = ((p.double() - b).abs().max() / b.abs().max()).item()
        assert err < tol, (name, err)
        assert err <= max(2 * err_plain, 1e-6), (name, err, err_plain)
    with torch.no_grad():  # no graph: the plain forward, the same values
        torch.testing.assert_close(norm(x0), got[0], rtol=0, atol=0)


def test_only_cpu_rms_norms_over_the_last_dim_with_a_weight_are_routed():
    """The routing skips norms without a weight, over several dimensions, or of another kind:
    those compute exactly as before; the routed one within float32 rounding of it."""
    from agent_r1.learner.backend.norm import install_fused_rms_norm

    norms = torch.nn.ModuleList(
        [torch.nn.RMSNorm(8), torch.nn.RMSNorm(8, elementwise_affine=False), torch.nn.LayerNorm(8),
         torch.nn.RMSNorm((2, 4))]
    )  # fmt: skip
    x = torch.randn(3, 8)
    before = [n(x if i < 3 else x.view(3, 2, 4)) for i, n in enumerate(norms)]
    assert install_fused_rms_norm(norms) == 1
    after = [n(x if i < 3 else x.view(3, 2, 4)) for i, n in enumerate(norms)]
    for i, (a, b) in enumerate(zip(before, after, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-6 if i == 0 else 0, atol=1e-6 if i == 0 else 0)


def test_a_cpu_learners_dry_run_keeps_the_routed_path(monkeypatch):
    """A dry run of a CPU learner (meta tensors) keeps the routed norm's path, so its accounting
    keeps what ``_RMSNorm`` keeps; an unrouted norm reaches the class's forward (where a dry run
    planning a GPU puts Transformer Engine's fused norm: such a plan never routes norms in,
    ``packed_forward``'s ``fused_plan``)."""
    from agent_r1.learner.backend.norm import install_fused_rms_norm

    calls = []
    monkeypatch.setattr(torch.nn.RMSNorm, "forward", lambda norm, x: calls.append(x.shape) or x * 1)
    x = torch.empty(4, 16, device="meta", requires_grad=True)
    torch.nn.RMSNorm(16, device="meta")(x)
    assert calls == [(4, 16)]
    norm = torch.nn.RMSNorm(16, device="meta")
    assert install_fused_rms_norm(norm) == 1
    y = norm(x)
    assert calls == [(4, 16)] and y.grad_fn is not None and type(y.grad_fn).__name__ == "_RMSNormBackward"
