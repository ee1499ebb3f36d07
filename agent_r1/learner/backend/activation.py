"""SwiGLU for a CPU learner, forward and backward in one native pass each.

Megatron's local layer spec runs a gated MLP's activation unfused (no Transformer Engine, and its
``bias_swiglu_impl`` is a TorchScript function that fuses nothing on a CPU): ``torch.chunk``, then
``F.silu(a) * (b + glu_linear_offset)`` forward, and mul, mul, ``silu_backward`` and the chunk's cat
backward; each a pass over (tokens x ffn) converting bf16 in and out, ~4 ms a layer for SmolLM2's
1,436 x 3,072. ``install_fused_swiglu`` gives each such MLP ``native/swiglu.cpp`` instead through
Megatron's own hook for an activation module (``use_te_activation_func``: the MLP calls
``self.activation_func`` on the whole fc1 output), set on that MLP's copy of the config only.
The kernel rounds what PyTorch's ops round, so the values are Megatron's unfused glu's; it keeps
the fc1 output alone for the backward (the unfused glu also keeps silu(a)).
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch
import torch.nn.functional as F

from agent_r1 import native


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, fns: Any) -> torch.Tensor:
        x = x.contiguous()
        ctx.save_for_backward(x)
        ctx.fns = fns
        return _run_forward(fns, x)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (x,) = ctx.saved_tensors
        dx = torch.empty_like(x)
        if ctx.fns is not _META:
            half = x.shape[-1] // 2
            native.call(ctx.fns[1], x, dy.contiguous(), dx, x.numel() // (2 * half), half)
        return dx, None


def _run_forward(fns: Any, x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    y = x.new_empty(*x.shape[:-1], half)
    if fns is not _META:
        native.call(fns[0], x, y, x.numel() // (2 * half), half)
    return y


_META = native.META  # a dry run of a CPU learner


@functools.cache
def _kernels(dtype: torch.dtype) -> tuple[Any, Any] | None:
    """(forward, backward) for activations of ``dtype``; None where they cannot be built."""
    return native.forward_backward("swiglu", dtype, "p p i32 i32", "p p p i32 i32")


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """silu(a) * b of x = [a, b] (halves of the last dimension): the native kernels on a CPU, meta
    tensors alike in a dry run of a CPU learner, Megatron's unfused glu everywhere else."""
    fns = None
    if x.device.type == "cpu":
        fns = _kernels(x.dtype)
    elif x.device.type == "meta":  # a dry run of a CPU learner
        fns = _META
    if fns is None:
        a, b = torch.chunk(x, 2, dim=-1)
        return F.silu(a) * b
    if torch.is_grad_enabled() and x.requires_grad:
        return _SwiGLU.apply(x, fns)
    return _run_forward(fns, x.contiguous())


def _plain_swiglu(config: Any) -> bool:
    """A gated SiLU MLP that Megatron's forward runs unfused, with nothing our kernel leaves out."""
    return (
        config.gated_linear_unit
        and config.activation_func is F.silu
        and not config.bias_activation_fusion
        and not config.use_te_activation_func
        and getattr(config, "activation_func_clamp_value", None) is None
        and getattr(config, "glu_linear_offset", 0.0) == 0.0
    )


def install_fused_swiglu(model: Any) -> int:
    """Route the activation of every Megatron ``MLP`` with a plain SwiGLU (dense layers and each
    expert) through ``swiglu`` (idempotent); how many it routed. Only MLPs whose weights are on the
    CPU or meta (a dry run of a CPU learner) are routed; ``swiglu`` itself falls back to the unfused
    glu where the kernel cannot be built. A dry run planning a GPU's kernels does not call this
    (``forward.packed_forward``'s ``fused_plan``)."""
    from megatron.core.transformer.mlp import MLP

    count = 0
    for m in model.modules():
        if not isinstance(m, MLP):
            continue
        if m.activation_func is swiglu:
            count += 1
            continue
        weight = getattr(m.linear_fc1, "weight", None)
        if weight is None or weight.device.type not in ("cpu", "meta") or not _plain_swiglu(m.config):
            continue
        m.config = copy.copy(m.config)  # this MLP's own: the flag below reaches no other module
        m.config.use_te_activation_func = True  # Megatron's MLP then calls self.activation_func(fc1 out)
        m.activation_func = swiglu
        count += 1
    return count
