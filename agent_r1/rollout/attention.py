"""Decode attention over the slot KV cache: each query row attends to a range of one slot's
positions, in place in the cache.

On a CPU the native kernel (``decode_attention.cpp``, built here once per machine with g++ and
cached) reads every key and value once, straight from the cache; PyTorch's batched matmuls over
the same strided views copied them first (bf16: two copies per layer, about half the step's
attention time). Elsewhere (a GPU), or where the kernel cannot be built (no compiler,
``AGENT_R1_NATIVE_ATTENTION=0``), the same attention runs as batched matmuls over the views.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_attention.cpp")
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
_KERNELS = {torch.float32: "agent_r1_decode_attention_f32", torch.bfloat16: "agent_r1_decode_attention_bf16"}


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

    def slot_ids(self) -> torch.Tensor:
        if self._slots32 is None:
            n = len(self.lo)
            s = torch.arange(n, device=self.lo.device) if self.slots is None else self.slots
            self._slots32 = s.to(torch.int32).contiguous()
        return self._slots32


def attend(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, span: Span, scale: float, native: bool = True):
    """softmax(q k^T * scale) v over each row's span, and its log-sum-exp (float32).

    q (N, kv, R, D): the R queries of each kv head; K, V (slots, kv, max_len, D): one layer of
    the cache. Returns o (N, kv, R, D) in q's dtype and lse (N, kv, R)."""
    fn = _native(q.dtype) if native and q.device.type == "cpu" else None
    if fn is None:
        return _matmul(q, K, V, span, scale)
    N, H, R, D = q.shape
    if q.stride(-1) != 1 or K.stride(-1) != 1 or K.stride() != V.stride():
        q, K, V = q.contiguous(), K.contiguous(), V.contiguous()
    out = torch.empty((N, H, R, D), dtype=q.dtype)
    lse = torch.empty((N, H, R), dtype=torch.float32)
    lo, hi = span.lo.to(torch.int32), span.hi.to(torch.int32)
    ptr = ctypes.c_void_p
    fn(
        ptr(q.data_ptr()), *q.stride()[:3], ptr(K.data_ptr()), ptr(V.data_ptr()), *K.stride()[:3],
        ptr(span.slot_ids().data_ptr()), ptr(lo.data_ptr()), ptr(hi.data_ptr()),
        N, H, R, D, ctypes.c_float(scale), ptr(out.data_ptr()), ptr(lse.data_ptr()), torch.get_num_threads(),
    )  # fmt: skip
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
    """The kernel for ``dtype`` (None: not available here; said once)."""
    if dtype not in _KERNELS or os.environ.get("AGENT_R1_NATIVE_ATTENTION", "1") == "0":
        return None
    try:
        lib = ctypes.CDLL(str(build()))
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("native decode attention unavailable (%s); using batched matmuls", e)
        return None
    fn = getattr(lib, _KERNELS[dtype])
    i64, i32, p = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    fn.argtypes = [p, i64, i64, i64, p, p, i64, i64, i64, p, p, p, i32, i32, i32, i32, ctypes.c_float, p, p, i32]  # fmt: skip
    fn.restype = None
    return fn


def build() -> Path:
    """Compile the kernel for this CPU and compiler once; the library's name hashes both with the
    source and flags, so a cache shared by different nodes holds one build per kind of node."""
    cxx = os.environ.get("CXX", "g++")
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    except FileNotFoundError as e:
        raise OSError(f"no C++ compiler ({cxx}); install g++") from e
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), version.encode(), _cpu_id().encode()):
        key.update(part)
    cache = Path(os.environ.get("AGENT_R1_KERNEL_CACHE") or Path.home() / ".cache" / "agent_r1" / "kernels")
    lib = cache / f"decode_attention-{key.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        out = Path(tmp) / lib.name
        done = subprocess.run([cxx, *FLAGS, str(SOURCE), "-o", str(out)], capture_output=True, text=True)
        if done.returncode != 0:
            raise OSError(f"{cxx} failed to build {SOURCE.name}: {done.stderr.strip()[-2000:]}")
        os.replace(out, lib)  # atomic: processes building at once each install a whole library
    log.info("built %s", lib)
    return lib


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return platform.processor()
    lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))
