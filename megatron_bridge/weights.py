"""HF tensors <-> Megatron-Core (local or TE spec) weights, for any TP/PP layout.

Megatron's fused QKV is grouped by query group: for each KV head g, the rows of its q heads, then
its k row block, then its v row block; tensor parallelism splits whole groups. ``linear_fc1`` is
``[gate; up]`` per TP shard. Row-parallel layers (``linear_proj``, ``linear_fc2``) split columns.
The vocabulary is zero-padded to the model's (TP-divisible) size and sliced back on export.

Mixture of experts: the router is ``mlp.router`` (HF ``mlp.gate``), expert ``e`` is local expert
``e % (E / ep)`` of expert-parallel rank ``e // (E / ep)`` (``mlp.experts.local_experts.{i}``, its
``linear_fc1`` ``[gate; up]`` whole: experts are not split by TP); export gathers them to the
EP group's first rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from megatron_bridge.archs import arch_for, language_config, moe_config


class _Dims:
    def __init__(self, hf: Any, tp: int):
        self.H = hf.hidden_size
        self.nq = hf.num_attention_heads
        self.nkv = getattr(hf, "num_key_value_heads", None) or self.nq
        self.D = getattr(hf, "head_dim", None) or self.H // self.nq
        self.g = self.nq // self.nkv
        self.ffn = hf.intermediate_size
        self.tp = tp


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d: _Dims) -> torch.Tensor:
    """(rows, ...) HF q/k/v -> Megatron's grouped layout, shape (nkv, (g + 2) D, ...)."""
    tail = q.shape[1:]
    return torch.cat(
        [q.reshape(d.nkv, d.g * d.D, *tail), k.reshape(d.nkv, d.D, *tail), v.reshape(d.nkv, d.D, *tail)],
        dim=1,
    )


def _split_qkv(x: torch.Tensor, d: _Dims) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron's grouped (nkv, (g + 2) D, ...) -> HF q, k, v (rows, ...)."""
    tail = x.shape[2:]
    q, k, v = x[:, : d.g * d.D], x[:, d.g * d.D : (d.g + 1) * d.D], x[:, (d.g + 1) * d.D :]
    return q.reshape(d.nq * d.D, *tail), k.reshape(d.nkv * d.D, *tail), v.reshape(d.nkv * d.D, *tail)


def _rows(t: torch.Tensor, r: int, n: int) -> torch.Tensor:
    return t.chunk(n, dim=0)[r]


def _cols(t: torch.Tensor, r: int, n: int) -> torch.Tensor:
    return t.chunk(n, dim=1)[r]


def _pad_vocab(w: torch.Tensor, vocab: int) -> torch.Tensor:
    if w.shape[0] == vocab:
        return w
    return torch.cat([w, w.new_zeros(vocab - w.shape[0], *w.shape[1:])])


def stage_layers(num_layers: int, pp: int, pp_rank: int, vpp: int = 1, vp_stage: int = 0) -> range:
    """The layers of pipeline rank ``pp_rank``'s (virtual) stage ``vp_stage``: Megatron's
    interleaving deals the ``pp * vpp`` equal stages out round-robin, rank by rank."""
    per = num_layers // (pp * vpp)
    start = (vp_stage * pp + pp_rank) * per
    return range(start, start + per)


def _virtual(model: Any) -> tuple[int, int]:
    """(vpp, vp_stage) of a GPTModel chunk: (1, 0) without virtual pipeline stages."""
    vp = getattr(model, "vp_stage", None)
    return (1, 0) if vp is None else (model.config.virtual_pipeline_model_parallel_size, vp)


def megatron_state(
    hf_state: dict[str, torch.Tensor],
    hf: Any,
    tp: int,
    tp_rank: int,
    pp: int,
    pp_rank: int,
    padded_vocab: int,
    ep: int = 1,
    ep_rank: int = 0,
    vpp: int = 1,
    vp_stage: int = 0,
) -> dict[str, torch.Tensor]:
    """The Megatron state dict of one (tp_rank, pp_rank, ep_rank) and virtual stage from full HF
    tensors."""
    hf = language_config(hf)
    arch, d, moe = arch_for(hf), _Dims(hf, tp), moe_config(hf)
    tied = bool(getattr(hf, "tie_word_embeddings", False))
    out: dict[str, torch.Tensor] = {}
    first, last = pp_rank == 0 and vp_stage == 0, pp_rank == pp - 1 and vp_stage == vpp - 1
    embed = _pad_vocab(hf_state["model.embed_tokens.weight"], padded_vocab)
    if first:
        out["embedding.word_embeddings.weight"] = _rows(embed, tp_rank, tp)
    for local, i in enumerate(stage_layers(hf.num_hidden_layers, pp, pp_rank, vpp, vp_stage)):
        h, m = f"model.layers.{i}.", f"decoder.layers.{local}."
        out[m + "input_layernorm.weight"] = hf_state[h + "input_layernorm.weight"]
        out[m + "pre_mlp_layernorm.weight"] = hf_state[h + "post_attention_layernorm.weight"]
        a = h + "self_attn."
        qkv = _fuse_qkv(
            hf_state[a + "q_proj.weight"], hf_state[a + "k_proj.weight"], hf_state[a + "v_proj.weight"], d
        )
        out[m + "self_attention.linear_qkv.weight"] = _rows(qkv, tp_rank, tp).reshape(-1, d.H)
        if arch.qkv_bias:
            b = _fuse_qkv(
                hf_state[a + "q_proj.bias"], hf_state[a + "k_proj.bias"], hf_state[a + "v_proj.bias"], d
            )
            out[m + "self_attention.linear_qkv.bias"] = _rows(b, tp_rank, tp).reshape(-1)
        if arch.qk_norm:
            out[m + "self_attention.q_layernorm.weight"] = hf_state[a + "q_norm.weight"]
            out[m + "self_attention.k_layernorm.weight"] = hf_state[a + "k_norm.weight"]
        out[m + "self_attention.linear_proj.weight"] = _cols(hf_state[a + "o_proj.weight"], tp_rank, tp)
        p = h + "mlp."
        if moe is not None:
            out[m + "mlp.router.weight"] = hf_state[p + "gate.weight"]
            per = moe.experts // ep
            for i in range(per):
                x, y = f"{p}experts.{ep_rank * per + i}.", f"{m}mlp.experts.local_experts.{i}."
                gate, up = hf_state[x + "gate_proj.weight"], hf_state[x + "up_proj.weight"]
                out[y + "linear_fc1.weight"] = torch.cat([gate, up])
                out[y + "linear_fc2.weight"] = hf_state[x + "down_proj.weight"]
            continue
        gate, up = (
            _rows(hf_state[p + "gate_proj.weight"], tp_rank, tp),
            _rows(hf_state[p + "up_proj.weight"], tp_rank, tp),
        )
        out[m + "mlp.linear_fc1.weight"] = torch.cat([gate, up])
        out[m + "mlp.linear_fc2.weight"] = _cols(hf_state[p + "down_proj.weight"], tp_rank, tp)
    if last:
        out["decoder.final_layernorm.weight"] = hf_state["model.norm.weight"]
        if not tied:
            out["output_layer.weight"] = _rows(
                _pad_vocab(hf_state["lm_head.weight"], padded_vocab), tp_rank, tp
            )
        elif not first:  # tied across stages: the last stage keeps its own synchronised copy
            out["output_layer.weight"] = _rows(embed, tp_rank, tp)
    return {k: v.contiguous().clone() for k, v in out.items()}


# The Transformer Engine spec fuses the pre-attention / pre-MLP norms into the following linear
# layers; the local spec keeps them as modules. Names differ only there.
_TE_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


def to_te_names(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in sd.items():
        for local, te in _TE_NAMES.items():
            if k.endswith("." + local):
                k = k[: -len(local)] + te
                break
        out[k] = v
    return out


def from_te_names(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in sd.items():
        for local, te in _TE_NAMES.items():
            if k.endswith("." + te):
                k = k[: -len(te)] + local
                break
        out[k] = v
    return out


def _is_te(model_keys) -> bool:
    return any(k.endswith("linear_qkv.layer_norm_weight") for k in model_keys)


def load_hf_weights(model: Any, hf_state: dict[str, torch.Tensor], hf: Any) -> None:
    """Copy full HF tensors into this rank's stage of a GPTModel built by ``build_gpt_model``."""
    from megatron.core import parallel_state as ps

    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    padded = model.vocab_size
    sd = megatron_state(
        hf_state,
        hf,
        tp,
        ps.get_tensor_model_parallel_rank(),
        pp,
        ps.get_pipeline_model_parallel_rank(),
        padded,
        ps.get_expert_model_parallel_world_size(),
        ps.get_expert_model_parallel_rank(),
        *_virtual(model),
    )
    own = {k for k in model.state_dict() if not k.endswith("_extra_state")}
    if _is_te(own):
        sd = to_te_names(sd)
    missing, unexpected = own - set(sd), set(sd) - own
    if missing or unexpected:
        raise KeyError(
            f"weight mapping mismatch: missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, t in sd.items():
            target = params.get(name)
            if target is None:
                target = model.state_dict()[name]
            if tuple(target.shape) != tuple(t.shape):
                raise ValueError(f"{name}: megatron shape {tuple(target.shape)} != mapped {tuple(t.shape)}")
            if t.device.type == "meta":  # a planned weight (agent-r1 plan): a shape, no values to copy
                continue
            target.copy_(t.to(target.dtype))


def _gather_tp(t: torch.Tensor, dim: int) -> torch.Tensor:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    if tp == 1:
        return t.detach().clone()
    parts = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(parts, t.detach().contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=dim)


def _gather_ep(local: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """This EP rank's experts' tensors -> every expert's, in expert order, on the EP group's first
    rank (the stage's first rank, which sends the stage on in a push); None on the others (they
    would otherwise each hold every expert of the stage at once)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    ep = ps.get_expert_model_parallel_world_size()
    if ep == 1:
        return [t.detach().clone() for t in local]
    group = ps.get_expert_model_parallel_group()
    first = dist.get_process_group_ranks(group)[0]
    stacked = torch.stack([t.detach() for t in local]).contiguous()
    parts = [torch.empty_like(stacked) for _ in range(ep)] if dist.get_rank() == first else None
    dist.gather(stacked, parts, dst=first, group=group)
    return None if parts is None else [t for part in parts for t in part.unbind(0)]


def export_hf_weights(model: Any, hf: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named full tensors of this rank's pipeline stage (gathered across TP, and for the
    experts to the first rank of the EP group: the others yield no expert), in order. Every TP
    and EP rank must iterate (the gathers are collective)."""
    from megatron.core import parallel_state as ps

    hf = language_config(hf)
    arch, d, moe = arch_for(hf), _Dims(hf, ps.get_tensor_model_parallel_world_size()), moe_config(hf)
    pp, pp_rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    vpp, vp_stage = _virtual(model)
    tied = bool(getattr(hf, "tie_word_embeddings", False))
    sd = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    if _is_te(sd):
        sd = from_te_names(sd)
    V = hf.vocab_size
    if pp_rank == 0 and vp_stage == 0:
        yield "model.embed_tokens.weight", _gather_tp(sd["embedding.word_embeddings.weight"], 0)[:V]
    for local, i in enumerate(stage_layers(hf.num_hidden_layers, pp, pp_rank, vpp, vp_stage)):
        h, m = f"model.layers.{i}.", f"decoder.layers.{local}."
        yield h + "input_layernorm.weight", sd[m + "input_layernorm.weight"].detach().clone()
        qkv = _gather_tp(sd[m + "self_attention.linear_qkv.weight"].reshape(-1, (d.g + 2) * d.D, d.H), 0)
        q, k, v = _split_qkv(qkv, d)
        yield h + "self_attn.q_proj.weight", q
        yield h + "self_attn.k_proj.weight", k
        yield h + "self_attn.v_proj.weight", v
        if arch.qkv_bias:
            b = _gather_tp(sd[m + "self_attention.linear_qkv.bias"].reshape(-1, (d.g + 2) * d.D), 0)
            qb, kb, vb = _split_qkv(b, d)
            yield h + "self_attn.q_proj.bias", qb
            yield h + "self_attn.k_proj.bias", kb
            yield h + "self_attn.v_proj.bias", vb
        if arch.qk_norm:
            yield h + "self_attn.q_norm.weight", sd[m + "self_attention.q_layernorm.weight"].detach().clone()
            yield h + "self_attn.k_norm.weight", sd[m + "self_attention.k_layernorm.weight"].detach().clone()
        yield h + "self_attn.o_proj.weight", _gather_tp(sd[m + "self_attention.linear_proj.weight"], 1)
        yield h + "post_attention_layernorm.weight", sd[m + "pre_mlp_layernorm.weight"].detach().clone()
        if moe is not None:
            yield h + "mlp.gate.weight", sd[m + "mlp.router.weight"].detach().clone()
            per = moe.experts // ps.get_expert_model_parallel_world_size()
            y = m + "mlp.experts.local_experts."
            fc1 = _gather_ep([sd[f"{y}{i}.linear_fc1.weight"] for i in range(per)])
            fc2 = _gather_ep([sd[f"{y}{i}.linear_fc2.weight"] for i in range(per)])
            for e, (w1, w2) in enumerate(zip(fc1 or [], fc2 or [], strict=True)):
                gate, up = w1.chunk(2, dim=0)
                yield f"{h}mlp.experts.{e}.gate_proj.weight", gate.contiguous()
                yield f"{h}mlp.experts.{e}.up_proj.weight", up.contiguous()
                yield f"{h}mlp.experts.{e}.down_proj.weight", w2
            continue
        fc1 = sd[m + "mlp.linear_fc1.weight"]
        gate, up = fc1.chunk(2, dim=0)
        yield h + "mlp.gate_proj.weight", _gather_tp(gate.contiguous(), 0)
        yield h + "mlp.up_proj.weight", _gather_tp(up.contiguous(), 0)
        yield h + "mlp.down_proj.weight", _gather_tp(sd[m + "mlp.linear_fc2.weight"], 1)
    if pp_rank == pp - 1 and vp_stage == vpp - 1:
        yield "model.norm.weight", sd["decoder.final_layernorm.weight"].detach().clone()
        if not tied:
            yield "lm_head.weight", _gather_tp(sd["output_layer.weight"], 0)[:V]
