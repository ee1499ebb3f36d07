"""A forward pass over HF Llama / Qwen2 / Qwen3 modules with a slot KV cache.

The HF model provides the weights and the layer modules (embedding, norms, projections, MLP,
rotary embedding); this module only changes where keys and values live: one preallocated tensor
``(layers, slots, kv_heads, max_len, head_dim)``. Running requests occupy slots ``0..R-1``, so a
decode step attends over a view of the cache, never a gathered copy.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

SUPPORTED = ("llama", "qwen2", "qwen3")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class SlotModel:
    def __init__(self, model: Any, slots: int, max_len: int):
        cfg = model.config
        if cfg.model_type not in SUPPORTED:
            raise ValueError(f"model_type {cfg.model_type!r} not supported; supported: {SUPPORTED}")
        self.model = model
        self.inner = model.model
        self.layers = list(self.inner.layers)
        attn = self.layers[0].self_attn
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scaling = float(getattr(attn, "scaling", self.head_dim**-0.5))
        self.qk_norm = hasattr(attn, "q_norm")
        self.slots, self.max_len = slots, max_len
        dtype = next(model.parameters()).dtype
        shape = (len(self.layers), slots, self.n_kv, max_len, self.head_dim)
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)

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

    def _qkv(self, layer: Any, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """h (B, T, hidden) -> q (B, heads, T, D), k, v (B, kv_heads, T, D), rotary applied."""
        B, T, _ = h.shape
        a = layer.self_attn
        q = a.q_proj(h).view(B, T, self.n_heads, self.head_dim)
        k = a.k_proj(h).view(B, T, self.n_kv, self.head_dim)
        v = a.v_proj(h).view(B, T, self.n_kv, self.head_dim)
        if self.qk_norm:
            q, k = a.q_norm(q), a.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, D)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return q, k, v

    def _finish(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.inner.norm(x)).float()

    @torch.inference_mode()
    def prefill(self, slot: int, ids: list[int], start: int) -> torch.Tensor:
        """Write KV for ``ids`` at positions start.. of ``slot``; logits (vocab,) of the last one."""
        T = len(ids)
        if start + T > self.max_len:
            raise ValueError(f"sequence of {start + T} tokens exceeds the cache length {self.max_len}")
        x = self.inner.embed_tokens(torch.tensor([ids]))
        pos = torch.arange(start, start + T).unsqueeze(0)
        cos, sin = self.inner.rotary_emb(x, pos)
        L = start + T
        mask = torch.ones(T, L, dtype=torch.bool).tril(diagonal=start)
        for li, layer in enumerate(self.layers):
            h = layer.input_layernorm(x)
            q, k, v = self._qkv(layer, h, cos, sin)
            self.k[li, slot, :, start:L] = k[0]
            self.v[li, slot, :, start:L] = v[0]
            K = self.k[li, slot : slot + 1, :, :L]
            V = self.v[li, slot : slot + 1, :, :L]
            o = F.scaled_dot_product_attention(q, K, V, attn_mask=mask, scale=self.scaling, enable_gqa=True)
            x = x + layer.self_attn.o_proj(o.transpose(1, 2).reshape(1, T, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self._finish(x[:, -1:])[0, 0]

    @torch.inference_mode()
    def decode(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """One token for each of slots 0..B-1 at positions ``pos`` (B,); logits (B, vocab)."""
        B = ids.numel()
        x = self.inner.embed_tokens(ids.view(B, 1))
        cos, sin = self.inner.rotary_emb(x, pos.view(B, 1))
        L = int(pos.max()) + 1
        mask = (torch.arange(L).view(1, L) <= pos.view(B, 1)).view(B, 1, 1, L)
        rows = torch.arange(B)
        for li, layer in enumerate(self.layers):
            h = layer.input_layernorm(x)
            q, k, v = self._qkv(layer, h, cos, sin)
            self.k[li, rows, :, pos] = k[:, :, 0]
            self.v[li, rows, :, pos] = v[:, :, 0]
            K = self.k[li, :B, :, :L]
            V = self.v[li, :B, :, :L]
            o = F.scaled_dot_product_attention(q, K, V, attn_mask=mask, scale=self.scaling, enable_gqa=True)
            x = x + layer.self_attn.o_proj(o.transpose(1, 2).reshape(B, 1, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self._finish(x)[:, 0]
