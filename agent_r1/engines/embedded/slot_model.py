"""A forward pass over HF Llama / Qwen2 / Qwen3 / Qwen3-MoE weights with a slot KV cache.

The HF model provides the weights; this module keeps fused copies (q|k|v and gate|up, refreshed
after every weight update), a precomputed rotary table, and one preallocated KV tensor
``(layers, slots, kv_heads, max_len, head_dim)``. Running requests occupy slots ``0..R-1``, so a
decode step attends over a view of the cache, never a gathered copy; prefill batches the
projections and MLPs of several requests' chunks into one matmul each.

The linear layers run through oneDNN with weights reordered once into its blocked layout (the op
PyTorch's inductor uses for CPU inference), measured 1.2-1.8x faster than ``F.linear`` here; where
oneDNN is missing or disagrees with ``F.linear`` on a probe, or ``AGENT_R1_ONEDNN=0``, they run
through ``F.linear``.
"""

from __future__ import annotations

import functools
import mmap
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from agent_r1 import native
from agent_r1.engines.embedded.attention import Span, attend
from agent_r1.vision.qwen2_vl import is_vision_config, mrope_sections

SUPPORTED = (
    "llama",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "qwen2_vl",
    "qwen2_5_vl",
)  # *_vl: the language model (mRoPE)


_HUGE = 2 << 20


def cache_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed KV-cache tensor. On a Linux CPU: anonymous memory in 2 MiB-aligned huge pages
    where the kernel grants them (``MADV_HUGEPAGE``, for transparent huge pages in "madvise" mode).
    A decode step reads hundreds of MB scattered over the cache's slots, and with 4 KiB pages each
    few KB of it costs a TLB walk (SmolLM2 in bf16, 64 rows at position 192, 2-core EPYC: attention
    over 30 layers 16.2 -> 14.0 ms, the decode step 74 -> 70 ms). Every page is touched here, once,
    as ``torch.zeros`` does: pages first touched inside decode steps stalled them on the kernel's
    compaction (the uniform benchmark 15.3-15.9 -> 18.2-18.5 s). Elsewhere ``torch.zeros``."""
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or not hasattr(mmap, "MADV_HUGEPAGE") or nbytes < _HUGE:
        return torch.zeros(shape, dtype=dtype, device=device)
    buf = mmap.mmap(-1, nbytes + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # no THP in this kernel: plain pages
        pass
    raw = torch.frombuffer(buf, dtype=torch.uint8)  # keeps the mapping alive as long as any view
    start = -raw.data_ptr() % _HUGE
    return raw[start : start + nbytes].zero_().view(dtype).view(shape)


@functools.cache
def _onednn(dtype: torch.dtype) -> bool:
    """oneDNN's prepacked linear is usable here and agrees with ``F.linear`` on a probe."""
    if os.environ.get("AGENT_R1_ONEDNN", "1") == "0" or not torch.backends.mkldnn.is_available():
        return False
    try:
        g = torch.Generator().manual_seed(0)
        w, x, b = (torch.randn(*shape, generator=g).to(dtype) for shape in ((24, 16), (5, 16), (24,)))
        y = torch.ops.mkldnn._linear_pointwise(
            x, torch.ops.mkldnn._reorder_linear_weight(w, 128), b, "none", [], ""
        )
        return torch.allclose(y.float(), F.linear(x, w, b).float(), rtol=2e-2, atol=2e-2)
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


class Linear:
    """y = x W^T + b with W prepacked for oneDNN when available (see the module doc).

    ``invariant``: every row's result is the same bits whatever the other rows and the thread
    count (batch invariance). oneDNN's prepacked kernel keeps a fixed reduction order per row for
    every batch size (``tests/rollout/test_batch_invariance.py`` checks it on each machine), so an
    invariant layer is packed at any size; ``F.linear`` is not (a one-row input takes a
    matrix-vector kernel, a 7-row one splits differently), so without oneDNN an invariant layer runs
    one row at a time through the same kernel."""

    __slots__ = ("weight", "bias", "packed", "rowwise")
    MIN_PACKED = 1 << 18  # smaller weights (the tiny models') measured faster through F.linear

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, invariant: bool = False):
        self.bias = bias
        cpu_onednn = weight.device.type == "cpu" and _onednn(weight.dtype)
        self.packed = (
            torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 128)
            if cpu_onednn and (invariant or weight.numel() >= self.MIN_PACKED)
            else None
        )
        self.weight = None if self.packed is not None else weight
        self.rowwise = invariant and self.packed is None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.rowwise and x.numel():
            rows = [F.linear(r, self.weight, self.bias) for r in x.reshape(-1, x.shape[-1])]
            return torch.stack(rows).view(*x.shape[:-1], -1)
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")


@dataclass
class _Layer:
    ln1: torch.Tensor
    ln1_eps: float
    ln2: torch.Tensor
    ln2_eps: float
    qkv: Linear  # (q + 2 kv, hidden)
    o: Linear
    gate_up: Linear | None  # (2 * inter, hidden); None in an MoE layer
    down: Linear | None
    q_norm: tuple[torch.Tensor, float] | None
    k_norm: tuple[torch.Tensor, float] | None
    experts: Experts | None = None


@dataclass
class Experts:
    """An MoE layer's routed experts as HF holds them: the router (E, hidden), every expert's
    gate|up (E, 2 * inter, hidden) and down (E, hidden, inter) projections."""

    router: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    topk: int
    norm_topk: bool

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """HF's routing: softmax over every expert in float32, the top k (renormalised when
        ``norm_topk``), each token through its k experts, summed with those weights."""
        probs = torch.softmax(F.linear(h, self.router).float(), dim=-1)
        weight, chosen = probs.topk(self.topk, dim=-1)
        if self.norm_topk:
            weight = weight / weight.sum(-1, keepdim=True)
        weight = weight.to(h.dtype)
        out = torch.zeros_like(h)
        for e in chosen.unique().tolist():
            rows, k = torch.where(chosen == e)
            gate, up = F.linear(h[rows], self.gate_up[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down[e]) * weight[rows, k, None]
            out.index_add_(0, rows, y)
        return out


def _eps(module: Any) -> float:
    return float(getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6)))


class SlotModel:
    def __init__(self, model: Any, slots: int, max_len: int, batch_invariant: bool = False):
        """``batch_invariant``: a request's logits are the same bits alone or in any batch (every
        linear layer ``Linear(invariant=True)``; the engine then also decodes without cascade
        attention). A dense model on the CPU only."""
        cfg = model.config
        if cfg.model_type not in SUPPORTED:
            raise ValueError(f"model_type {cfg.model_type!r} not supported; supported: {SUPPORTED}")
        self.batch_invariant = batch_invariant
        if batch_invariant and (
            cfg.model_type == "qwen3_moe" or next(model.parameters()).device.type != "cpu"
        ):
            raise ValueError(
                "a batch-invariant engine (trainer.deterministic) runs dense models on the CPU; "
                f"this one is {cfg.model_type} on {next(model.parameters()).device}"
            )
        self.model = model
        self.vision = is_vision_config(cfg)
        self.inner = model.model.language_model if self.vision else model.model
        cfg = cfg.text_config if self.vision else cfg
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg.hidden_act!r} not supported (silu only)")
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        attn = self.inner.layers[0].self_attn
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scaling = float(getattr(attn, "scaling", self.head_dim**-0.5))
        self.slots, self.max_len = slots, max_len
        self.dtype = next(model.parameters()).dtype
        self.device = dev = next(model.parameters()).device  # the KV cache and every index live here
        shape = (len(self.inner.layers), slots, self.n_kv, max_len, self.head_dim)
        self.k, self.v = (cache_zeros(shape, self.dtype, dev) for _ in range(2))
        self.native = True  # decode through the native CPU kernels where they build (agent_r1/native)
        with torch.no_grad():
            probe = torch.zeros(1, 1, cfg.hidden_size, dtype=self.dtype, device=dev)
            cos, sin = self.inner.rotary_emb(probe, torch.arange(max_len, device=dev).unsqueeze(0))
        # (max_len, head_dim), same numerics as HF; rotate_half(x) * sin == roll(x) * signed_sin
        half = self.head_dim // 2
        self.cos, self.signed_sin = cos[0], torch.cat([-sin[0][:, :half], sin[0][:, half:]], -1)
        # mRoPE: rotary dimension d turns with position row sections[d] (t, h, w); the tables above
        # hold every dimension at every position, so a 3-row position gathers per dimension
        self.sections = mrope_sections(model.config, self.head_dim).to(dev) if self.vision else None
        self.refresh()

    def refresh(self) -> None:
        """Rebuild the fused weights from the HF modules (after loading new weights)."""
        layers = []
        lin = functools.partial(Linear, invariant=self.batch_invariant)
        with torch.no_grad():
            for layer in self.inner.layers:
                a, m = layer.self_attn, layer.mlp
                moe = hasattr(m, "experts")
                bias = [p.bias for p in (a.q_proj, a.k_proj, a.v_proj)]
                layers.append(
                    _Layer(
                        ln1=layer.input_layernorm.weight,
                        ln1_eps=_eps(layer.input_layernorm),
                        ln2=layer.post_attention_layernorm.weight,
                        ln2_eps=_eps(layer.post_attention_layernorm),
                        qkv=lin(
                            torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                            torch.cat(bias) if bias[0] is not None else None,
                        ),
                        o=lin(a.o_proj.weight),
                        gate_up=None if moe else lin(torch.cat([m.gate_proj.weight, m.up_proj.weight])),
                        down=None if moe else lin(m.down_proj.weight),
                        experts=Experts(
                            m.gate.weight,
                            m.experts.gate_up_proj,
                            m.experts.down_proj,
                            m.gate.top_k,
                            m.gate.norm_topk_prob,
                        )
                        if moe
                        else None,
                        q_norm=(a.q_norm.weight, _eps(a.q_norm)) if hasattr(a, "q_norm") else None,
                        k_norm=(a.k_norm.weight, _eps(a.k_norm)) if hasattr(a, "k_norm") else None,
                    )
                )
        self.layers = layers
        self.norm = (self.inner.norm.weight, _eps(self.inner.norm))
        self.embed = self.inner.embed_tokens.weight
        self.lm_head = lin(self.model.lm_head.weight)

    @property
    def kv_bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        if src != dst and length > 0:
            self.k[:, dst, :, :length] = self.k[:, src, :, :length]
            self.v[:, dst, :, :length] = self.v[:, src, :, :length]

    def load_slot(self, dst: int, k: torch.Tensor, v: torch.Tensor) -> None:
        n = k.shape[2]
        self.k[:, dst, :, :n] = k
        self.v[:, dst, :, :n] = v

    def save_slot(self, src: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[:, src, :, :length].clone(), self.v[:, src, :, :length].clone()

    # ---- shared pieces ---------------------------------------------------------------------------
    def _rope(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary tables for positions ``pos`` (N,) or multimodal positions (3, N), gathered once
        per forward: (N, 1, D) each."""
        if pos.dim() == 1:
            return self.cos[pos].unsqueeze(1), self.signed_sin[pos].unsqueeze(1)
        idx = pos[self.sections].T  # (N, D): the position row each dimension turns with
        return self.cos.gather(0, idx).unsqueeze(1), self.signed_sin.gather(0, idx).unsqueeze(1)

    def _qkv(self, L: _Layer, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        """h (N, hidden), the normed stream -> q (N, heads, D), k, v (N, kv, D); q and k rotated together."""
        N = h.shape[0]
        qkv = L.qkv(h)
        D, H = self.head_dim, self.n_heads
        qk = qkv[:, : (H + self.n_kv) * D].view(N, H + self.n_kv, D)
        v = qkv[:, (H + self.n_kv) * D :].view(N, self.n_kv, D)
        if L.q_norm is not None:
            qk = torch.cat(
                [
                    F.rms_norm(qk[:, :H], (D,), L.q_norm[0], L.q_norm[1]),
                    F.rms_norm(qk[:, H:], (D,), L.k_norm[0], L.k_norm[1]),
                ],
                1,
            )
        cos, sin = rope
        qk = qk * cos + qk.roll(D // 2, -1) * sin
        return qk[:, :H], qk[:, H:], v

    def _qkv_native(self, store, L: _Layer, h, rope, li: int, rows: torch.Tensor, pos: torch.Tensor):
        """``_qkv`` and the cache writes of N tokens in one kernel (``rope_store.cpp``): q
        (N, heads, D) back, token n's k and v written at (rows[n], pos[n]) of layer ``li``."""
        N, D, H = h.shape[0], self.head_dim, self.n_heads
        qkv = L.qkv(h)
        q = qkv.new_empty(N, H, D)
        K, V = self.k[li], self.v[li]
        qn, kn = L.q_norm or (None, 0.0), L.k_norm or (None, 0.0)
        native.call(
            store, qkv, qkv.stride(0), N, H, self.n_kv, D, rope[0], rope[1], qn[0], kn[0], qn[1], kn[1], q, K, V,
            *K.stride()[:3], rows, pos,
        )  # fmt: skip
        return q

    def _ffn(self, glue: _Glue, L: _Layer, h: torch.Tensor) -> torch.Tensor:
        """The MLP's output for the normed stream ``h`` (the residual add is the next norm's)."""
        if L.experts is not None:
            return L.experts(h)
        return L.down(glue.swiglu(L.gate_up(h)))

    def _layers(self, x: torch.Tensor, attention) -> torch.Tensor:
        """Every decoder layer over the stream ``x`` (N, hidden; updated in place); ``attention(li,
        L, h)`` -> (N, heads * D) for the normed stream ``h``. Returns the final norm's output (the
        logits are ``lm_head`` of its rows, in the model's dtype: the sampler reads them as they are)."""
        glue = _Glue.get(self.dtype, self.native and self.device.type == "cpu")
        ln = [(L.ln1, L.ln1_eps) for L in self.layers[1:]] + [self.norm]
        x, h = glue.norm(x, *(self.layers[0].ln1, self.layers[0].ln1_eps))
        for li, L in enumerate(self.layers):
            x, h = glue.norm(x, L.ln2, L.ln2_eps, add=L.o(attention(li, L, h)))
            x, h = glue.norm(x, *ln[li], add=self._ffn(glue, L, h))
        return h

    # ---- prefill / decode ------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill_many(
        self,
        items: list[tuple[int, list[int], int]],
        rope: list[torch.Tensor | None] | None = None,
        embeds: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None,
        out_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """items = (slot, token ids, start position): write their KV; logits (len(items), vocab) of
        each item's last token (``out_rows``: of these rows of the items' tokens laid end to end
        instead). Projections and MLPs run once over all items' tokens.

        Images (Qwen2-VL): ``rope[j]`` = item j's (3, n) rotary positions (None: start..start+n-1
        on all rows); ``embeds[j]`` = (offsets in the item, rows) replacing those tokens'
        embeddings (the vision tower's output for its image pads)."""
        for _slot, ids, start in items:
            if start + len(ids) > self.max_len:
                raise ValueError(
                    f"sequence of {start + len(ids)} tokens exceeds the cache length {self.max_len}"
                )
        flat = [t for _, ids, _ in items for t in ids]
        dev = self.device
        pos = torch.cat([torch.arange(start, start + len(ids), device=dev) for _, ids, start in items])
        bounds = np.cumsum([0] + [len(ids) for _, ids, _ in items]).tolist()
        x = F.embedding(torch.tensor(flat, device=dev), self.embed)
        for j, e in enumerate(embeds or []):
            if e is not None:
                x[bounds[j] + e[0].to(dev)] = e[1].to(x.dtype)
        if rope is not None and any(r is not None for r in rope):
            pos = torch.cat(
                [
                    r.to(dev) if r is not None else torch.arange(s, s + len(ids), device=dev).expand(3, -1)
                    for r, (_, ids, s) in zip(rope, items, strict=True)
                ],
                1,
            )
        rope_tabs = self._rope(pos)
        store = (
            _rope_store(self.dtype) if self.native and self.device.type == "cpu" and pos.dim() == 1 else None
        )
        if store is not None:  # every token's cache row
            rows = torch.tensor([slot for slot, ids, _ in items for _ in ids], device=dev)
            span = Span(torch.zeros_like(pos), pos + 1, rows)

        def attention(li: int, L: _Layer, h: torch.Tensor) -> torch.Tensor:
            if store is not None:  # norms, rotation, cache writes of all tokens in one kernel; then
                # each token a row of the decode kernel over its slot's positions 0..pos
                q = self._qkv_native(store, L, h, rope_tabs, li, rows, pos)
                qg = q.view(len(rows), self.n_kv, self.n_heads // self.n_kv, self.head_dim)
                return attend(qg, self.k[li], self.v[li], span, self.scaling, self.native)[0].view(
                    len(rows), -1
                )
            q, k, v = self._qkv(L, h, rope_tabs)
            outs = []
            for j, (slot, _ids, start) in enumerate(items):
                a, b = bounds[j], bounds[j + 1]
                T, end = b - a, start + b - a
                self.k[li, slot, :, start:end] = k[a:b].transpose(0, 1)
                self.v[li, slot, :, start:end] = v[a:b].transpose(0, 1)
                mask = torch.ones(T, end, dtype=torch.bool, device=dev).tril(diagonal=start)
                o = F.scaled_dot_product_attention(
                    q[a:b].transpose(0, 1).unsqueeze(0),
                    self.k[li, slot : slot + 1, :, :end],
                    self.v[li, slot : slot + 1, :, :end],
                    attn_mask=mask,
                    scale=self.scaling,
                    enable_gqa=True,
                )
                outs.append(o[0].transpose(0, 1).reshape(T, -1))
            return torch.cat(outs)

        h = self._layers(x, attention)
        return self.lm_head(h[torch.tensor(bounds[1:], device=dev) - 1 if out_rows is None else out_rows])

    def prefill(self, slot: int, ids: list[int], start: int) -> torch.Tensor:
        return self.prefill_many([(slot, ids, start)])[0]

    @torch.inference_mode()
    def decode(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        shared: list[tuple[int, list[int]]] | None = None,
        rope_pos: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One token for each of slots 0..B-1 at positions ``pos`` (B,); logits (B, vocab).
        ``rope_pos`` (B,): the rotary positions when they differ from ``pos`` (after an image,
        Qwen2-VL's text positions run ``delta`` apart from the cache positions).

        ``shared``: (P, slots) groups covering every slot, whose members hold the same KV in
        positions 0..P-1 (the samples of one prompt). Attention then reads that prefix once per
        group, from its first slot, for all the group's queries, and each slot's own positions
        P..pos; the two partial softmaxes are merged exactly (cascade attention)."""
        B = ids.numel()
        x = F.embedding(ids, self.embed)
        cascade = _Cascade(shared, pos, self.n_kv, self.n_heads // self.n_kv) if shared else None
        own = Span(cascade.row_start if cascade else torch.zeros_like(pos), pos + 1)
        group = self.n_heads // self.n_kv
        rows = torch.arange(B, device=pos.device)
        rope = self._rope(pos if rope_pos is None else rope_pos)
        store = _rope_store(self.dtype) if self.native and self.device.type == "cpu" else None

        def attention(li: int, L: _Layer, h: torch.Tensor) -> torch.Tensor:
            if store is None:
                q, k, v = self._qkv(L, h, rope)
                self.k[li, rows, :, pos] = k
                self.v[li, rows, :, pos] = v
            else:
                q = self._qkv_native(store, L, h, rope, li, rows, pos)
            # grouped-query attention: a kv head's `group` queries attend together, no expanded K/V
            qg = q.view(B, self.n_kv, group, self.head_dim)
            o, lse = attend(qg, self.k[li], self.v[li], own, self.scaling, self.native)
            if cascade is not None:
                o = cascade.merge(qg, self.k[li], self.v[li], o, lse, self.scaling, self.native)
            return o.reshape(B, -1)

        return self.lm_head(self._layers(x, attention))


class _Glue:
    """The elementwise work between a layer's matmuls: ``norm`` (the residual add, then RMSNorm)
    and ``swiglu``; through the native kernels (``glue.cpp``, HF's rounding) where they build,
    else PyTorch ops."""

    def __init__(self, dtype: torch.dtype, native_kernels: bool):
        self.add_norm = self.silu_mul = None
        if native_kernels:  # a CPU model (no build on a GPU node)
            self.add_norm = native.function(
                "glue", "agent_r1_add_rms_norm", dtype, "p i64 p i64 p f32 p i64 i32 i32"
            )
            self.silu_mul = native.function("glue", "agent_r1_silu_mul", dtype, "p i64 p i32 i32")

    @staticmethod
    @functools.cache
    def get(dtype: torch.dtype, native_kernels: bool) -> _Glue:
        return _Glue(dtype, native_kernels)

    def norm(self, x: torch.Tensor, w: torch.Tensor, eps: float, add: torch.Tensor | None = None):
        """(x + add, RMSNorm(x + add) * w); the native path adds into ``x`` in place."""
        if self.add_norm is None or x.stride(-1) != 1 or (add is not None and add.stride(-1) != 1):
            x = x if add is None else x + add
            return x, F.rms_norm(x, (x.shape[-1],), w, eps)
        out = torch.empty_like(x)
        M, H = x.shape
        native.call(
            self.add_norm, x, x.stride(0), add, 0 if add is None else add.stride(0), w, eps, out, H, M, H
        )
        return x, out

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of the fused (M, 2I) projection."""
        if self.silu_mul is None or gate_up.stride(-1) != 1:
            gate, up = gate_up.chunk(2, dim=-1)
            return F.silu(gate) * up
        M, I2 = gate_up.shape
        out = gate_up.new_empty(M, I2 // 2)
        native.call(self.silu_mul, gate_up, gate_up.stride(0), out, M, I2 // 2)
        return out


@functools.cache
def _rope_store(dtype: torch.dtype):
    sig = "p i64 i32 i32 i32 i32 p p p p f32 f32 p p p i64 i64 i64 p p"
    return native.function("rope_store", "agent_r1_rope_store", dtype, sig)


class _Cascade:
    """Index plan of one decode step's shared-prefix attention (built once, used by every layer)."""

    def __init__(self, shared: list[tuple[int, list[int]]], pos: torch.Tensor, n_kv: int, group: int):
        B = pos.numel()
        self.G, self.M = len(shared), max(len(slots) for _, slots in shared)
        dev = pos.device
        self.leaders = torch.tensor([slots[0] for _, slots in shared], device=dev)
        g_idx, j_idx, row_start = [0] * B, [0] * B, [0] * B
        for g, (p, slots) in enumerate(shared):
            for j, slot in enumerate(slots):
                g_idx[slot], j_idx[slot], row_start[slot] = g, j, p
        self.g_idx, self.j_idx = torch.tensor(g_idx, device=dev), torch.tensor(j_idx, device=dev)
        self.row_start = torch.tensor(row_start, device=dev)  # each row's own part starts at its group's P
        plen = torch.tensor([p for p, _ in shared], device=dev)
        self.prefix = Span(torch.zeros_like(plen), plen, self.leaders)  # each group's prompt, once
        self.n_kv, self.group = n_kv, group

    def merge(self, qg, K, V, o, lse, scale, kernel):
        """Add the prefix part to each row's own part (``o``, normalised over the row's own
        positions, whose log-sum-exp is ``lse``): the two softmaxes weighted by their sums."""
        B, kv, grp, D = qg.shape
        G, M = self.G, self.M
        Q = qg.new_zeros(G, M, kv, grp, D)
        Q[self.g_idx, self.j_idx] = qg
        Q = Q.permute(0, 2, 1, 3, 4).reshape(G, kv, M * grp, D)
        o_p, lse_p = attend(Q, K, V, self.prefix, scale, kernel)

        def rows(t: torch.Tensor) -> torch.Tensor:  # (G, kv, M*grp, X) -> (B, kv, grp, X)
            return t.view(G, kv, M, grp, -1).permute(0, 2, 1, 3, 4)[self.g_idx, self.j_idx]

        o_p, lse_p = rows(o_p), rows(lse_p.unsqueeze(-1))
        lse = lse.unsqueeze(-1)
        total = torch.logaddexp(lse, lse_p)
        return (o.float() * torch.exp(lse - total) + o_p.float() * torch.exp(lse_p - total)).to(o.dtype)
