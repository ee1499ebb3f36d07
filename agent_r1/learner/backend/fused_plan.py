"""A GPU's fused kernels as a plan counts them (``dry_run`` with ``fused_kernels``): what each keeps
for its backward, computed on meta tensors (nothing is computed)."""

from __future__ import annotations

import torch


class _FusedAttention(torch.autograd.Function):
    """What a GPU's fused (flash) attention keeps, without computing it: the output, and for the
    backward q, k, v, the output and fp32 softmax statistics per head and row (no L x L scores)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        s, heads, hn = q.shape
        out = q.new_empty((s, heads * hn))
        stats = torch.empty((heads, s), dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, stats)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class _FusedRMSNorm(torch.autograd.Function):
    """Transformer Engine's fused RMSNorm, planned: the output in the input's dtype; the input,
    the weight and fp32 inverse norms per row kept for the backward (no fp32 copies of the rows)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
        ctx.save_for_backward(x, weight, rstd)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, _ = ctx.saved_tensors
        return torch.empty_like(x), torch.empty_like(weight)


class _FusedRope(torch.autograd.Function):
    """A fused rotary embedding, planned: the output in the input's dtype, nothing kept."""

    @staticmethod
    def forward(ctx, t: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return torch.empty_like(grad)


def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """(s, heads, hn) queries, (s, groups, hn) keys and values -> (s, heads * hn), as planned."""
    return _FusedAttention.apply(q, k, v)
