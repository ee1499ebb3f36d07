"""RMSNorm for a CPU learner, forward and backward in one native pass per row each.

Megatron's local layer spec builds its norms as ``torch.nn.RMSNorm`` (``WrappedTorchNorm``, no
Transformer Engine or apex here), with float32 weights even in a bf16 model. PyTorch then cannot
use its fused kernel ("Mismatch dtype between input and weight") and runs the norm as ~8
elementwise ops forward and ~10 backward over (tokens x hidden), each a pass with conversions:
~4 ms a norm for SmolLM2's 1,436 x 576, 61 norms: ~250 ms of a 4 s bf16 update.
``install_fused_rms_norm`` routes each norm through ``native/rms_norm.cpp`` instead: float32
inside, the output and dx rounded once to the activations' dtype (PyTorch's numerics), the
weight's gradient summed in float32.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from agent_r1 import native


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, fns: Any) -> torch.Tensor:
        x = x.contiguous()
        ctx.save_for_backward(x, weight)
        ctx.eps, ctx.fns = eps, fns
        return _run_forward(fns, x, weight, eps)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight = ctx.saved_tensors
        dy = dy.contiguous()
        H = x.shape[-1]
        dx = torch.empty_like(x)
        dw = torch.empty(H, dtype=torch.float32, device=x.device)
        if ctx.fns is not _META:
            native.call(ctx.fns[1], x, dy, weight.float().contiguous(), ctx.eps, dx, dw, x.numel() // H, H)
        return dx, dw.to(weight.dtype), None, None


def _run_forward(fns: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    H = x.shape[-1]
    y = torch.empty_like(x)
    if fns is not _META:
        native.call(fns[0], x, weight.float().contiguous(), eps, y, x.numel() // H, H)
    return y


_META = native.META  # a dry run of a CPU learner


@functools.cache
def _kernels(dtype: torch.dtype) -> tuple[Any, Any] | None:
    """(forward, backward) for activations of ``dtype``; None where they cannot be built."""
    return native.forward_backward("rms_norm", dtype, "p p f32 p i32 i32", "p p p f32 p p i32 i32")


def _forward(norm: torch.nn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
    w = norm.weight
    eps = norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps
    fns = None
    if x.device.type == w.device.type == "cpu":
        fns = _kernels(x.dtype)
    elif x.device.type == w.device.type == "meta":  # a dry run of a CPU learner
        fns = _META
    if fns is None:  # the class's forward
        return torch.nn.RMSNorm.forward(norm, x)
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return _RMSNorm.apply(x, w, eps, fns)
    return _run_forward(fns, x.contiguous(), w, eps)


def install_fused_rms_norm(model: Any) -> int:
    """Route every ``torch.nn.RMSNorm`` over the last dimension with a weight, on the CPU, through
    ``_RMSNorm`` (idempotent); how many it routed. Nothing changes where the kernel cannot be built
    (``_forward`` falls back to the class's forward) or on other devices. A dry run of a CPU learner
    (meta tensors) routes them too, so its accounting keeps what ``_RMSNorm`` keeps; one that
    plans a GPU's kernels does not call this (``forward.packed_forward``'s ``fused_plan``)."""
    count = 0
    for m in model.modules():
        if (
            type(m) is torch.nn.RMSNorm
            and m.weight is not None
            and len(m.normalized_shape) == 1
            and m.weight.device.type in ("cpu", "meta")
        ):
            if not isinstance(m.forward, functools.partial):
                m.forward = functools.partial(_forward, m)
            count += 1
    return count
