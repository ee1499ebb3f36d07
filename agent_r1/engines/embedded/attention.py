"""Decode attention over the slot KV cache: each query row attends to a range of one slot's
positions, in place in the cache.

On a CPU the native kernel (``agent_r1/native/decode_attention.cpp``, built once per machine:
``agent_r1.native``) reads every key and value once, straight from the cache; PyTorch's batched matmuls over
the same strided views copied them first (bf16: two copies per layer, about half the step's
attention time). Elsewhere (a GPU), or where the kernel cannot be built (no compiler,
``AGENT_R1_NATIVE=0``), the same attention runs as batched matmuls over the views.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from agent_r1 import native


@dataclass
class Span:
    """Row n attends to positions ``lo[n] <= t < hi[n]`` of cache slot ``slots[n]`` (slots
    0..N-1 when ``slots`` is None); int32 tensors of N on the cache's device."""

    lo: torch.Tensor
    hi: torch.Tensor
    slots: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.start, self.end = int(self.lo.min()), int(self.hi.max())
        self._bias: dict[torch.dtype, torch.Tensor] = {}
        self._slots32: torch.Tensor | None = None
        self._range32: tuple[torch.Tensor, torch.Tensor] | None = None

    def bias(self, dtype: torch.dtype) -> torch.Tensor:
        """(N, 1, 1, end - start): 0 where a row attends, -inf elsewhere."""
        if dtype not in self._bias:
            cols = torch.arange(self.start, self.end, device=self.lo.device).view(1, -1)
            masked = (cols < self.lo.view(-1, 1)) | (cols >= self.hi.view(-1, 1))
            bias = torch.zeros(masked.shape, dtype=dtype, device=masked.device).masked_fill_(
                masked, float("-inf")
            )
            self._bias[dtype] = bias.view(len(self.lo), 1, 1, -1)
        return self._bias[dtype]

    def range32(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``lo`` and ``hi`` as int32 (converted once: every layer's call reads them)."""
        if self._range32 is None:
            self._range32 = self.lo.to(torch.int32).contiguous(), self.hi.to(torch.int32).contiguous()
        return self._range32

    def slot_ids(self) -> torch.Tensor:
        if self._slots32 is None:
            n = len(self.lo)
            s = torch.arange(n, device=self.lo.device) if self.slots is None else self.slots
            self._slots32 = s.to(torch.int32).contiguous()
        return self._slots32


def attend(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, span: Span, scale: float, kernel: bool = True):
    """softmax(q k^T * scale) v over each row's span, and its log-sum-exp (float32).

    q (N, kv, R, D): the R queries of each kv head; K, V (slots, kv, max_len, D): one layer of
    the cache. Returns o (N, kv, R, D) in q's dtype and lse (N, kv, R)."""
    fn = _native(q.dtype) if kernel and q.device.type == "cpu" else None
    if fn is None:
        return _matmul(q, K, V, span, scale)
    N, H, R, D = q.shape
    if q.stride(-1) != 1 or K.stride(-1) != 1 or K.stride() != V.stride():
        q, K, V = q.contiguous(), K.contiguous(), V.contiguous()
    out = torch.empty((N, H, R, D), dtype=q.dtype)
    lse = torch.empty((N, H, R), dtype=torch.float32)
    native.call(
        fn,
        q,
        *q.stride()[:3],
        K,
        V,
        *K.stride()[:3],
        span.slot_ids(),
        *span.range32(),
        N,
        H,
        R,
        D,
        scale,
        out,
        lse,
    )
    return out, lse


def _matmul(q, K, V, span: Span, scale: float):
    N = q.shape[0]
    rows = slice(0, N) if span.slots is None else span.slots
    K, V = K[rows, :, span.start : span.end], V[rows, :, span.start : span.end]
    if K.device.type == "cpu" and K.dtype != torch.float32:
        K = K.contiguous()  # bf16 bmm over the transposed strided view goes through a slow copy
    s = torch.matmul(q, K.transpose(-1, -2)).float() * scale + span.bias(torch.float32)
    lse = torch.logsumexp(s, -1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)).to(V.dtype), V), lse


@functools.cache
def _native(dtype: torch.dtype):
    """The kernel for ``dtype`` (None: not available here)."""
    sig = "p i64 i64 i64 p p i64 i64 i64 p p p i32 i32 i32 i32 f32 p p"
    return native.function("decode_attention", "agent_r1_decode_attention", dtype, sig)
