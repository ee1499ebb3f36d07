"""HF config -> Megatron TransformerConfig, GPTModel arguments and layer spec."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatron_bridge.archs import arch_for, language_config, moe_config


def te_available() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except (ImportError, RuntimeError):  # RuntimeError: TE's empty meta package
        return False
    return torch.cuda.is_available()


@dataclass
class BridgeConfig:
    tp: int = 1
    pp: int = 1
    ep: int = 1  # expert parallel: each rank of an EP group holds experts / ep of them (MoE only)
    sp: bool = False  # sequence parallel (tp > 1): the residual stream split over the TP ranks
    vpp: int = 1  # virtual pipeline stages per pipeline rank (interleaved schedule; pp > 1)
    cp: int = 1  # context parallel: each sequence split over cp ranks (agent_r1.learner.context_parallel)
    dtype: str = "float32"  # float32 | bfloat16
    precision: str = "default"  # default | fp8 (Transformer Engine on GPU only)
    fp8_recipe: str = "delayed"  # delayed | tensorwise (current scaling)
    vocab_multiple: int = 128  # the embedding is padded so each TP rank gets an equal slice
    recompute: bool = False
    # build as on a GPU (no CPU adaptations in the TransformerConfig); None: where CUDA is available.
    # A dry run planning a GPU rank on a CPU machine sets it (agent_r1.learner.backend.Backend)
    for_gpu: bool | None = None

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1 or self.ep < 1:
            raise ValueError(
                f"parallel.tp, parallel.pp and parallel.ep must be >= 1, got {self.tp}, {self.pp}, {self.ep}"
            )
        if self.sp and self.tp == 1:
            raise ValueError("parallel.sp needs parallel.tp > 1 (it splits tokens over the TP ranks)")
        if self.cp < 1:
            raise ValueError(f"parallel.cp must be >= 1, got {self.cp}")
        if self.vpp < 1 or (self.vpp > 1 and self.pp == 1):
            raise ValueError(f"parallel.vpp must be >= 1, and > 1 only with parallel.pp > 1; got {self.vpp}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"model.dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.precision not in ("default", "fp8"):
            raise ValueError(f"model.precision must be default or fp8, got {self.precision!r}")
        if self.fp8_recipe not in ("delayed", "tensorwise"):
            raise ValueError(f"model.fp8_recipe must be delayed or tensorwise, got {self.fp8_recipe!r}")


def gpt_model(model: Any) -> Any:
    """The ``GPTModel`` inside Megatron's wrappers (DDP, ``Float16Module``)."""
    while not hasattr(model, "decoder") and hasattr(model, "module"):
        model = model.module
    return model


def padded_vocab(vocab: int, multiple: int, tp: int) -> int:
    m = multiple * tp
    return ((vocab + m - 1) // m) * m


def megatron_config(hf: Any, bc: BridgeConfig):
    """(TransformerConfig, gpt_model_kwargs, layer_spec) for an HF config."""
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    arch, hf = arch_for(hf), language_config(hf)
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf.hidden_act!r} not supported (silu only)")
    if bc.precision == "fp8" and not te_available():
        raise RuntimeError(
            "model.precision=fp8 needs Transformer Engine and a CUDA GPU; neither is available here"
        )
    if bc.precision == "fp8" and arch.mrope:
        raise ValueError(
            f"model.precision=fp8 needs the Transformer Engine layer spec, and {arch.model_type}'s "
            "multimodal rotary positions run on the local spec: use model.precision=default"
        )
    if hf.num_hidden_layers % (bc.pp * bc.vpp):
        stages = f"parallel.pp={bc.pp}" + (f" x parallel.vpp={bc.vpp}" if bc.vpp > 1 else "")
        raise ValueError(f"{stages} must divide num_hidden_layers={hf.num_hidden_layers}")
    kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    if kv_heads % bc.tp or hf.num_attention_heads % bc.tp:
        raise ValueError(
            f"parallel.tp={bc.tp} must divide the attention heads ({hf.num_attention_heads}) and kv heads ({kv_heads})"
        )
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    moe = moe_config(hf)
    if moe is None and bc.ep > 1:
        raise ValueError(f"parallel.ep={bc.ep} needs a mixture-of-experts model; {hf.model_type} is dense")
    if moe is not None and moe.experts % bc.ep:
        raise ValueError(f"parallel.ep={bc.ep} must divide the model's experts ({moe.experts})")
    if moe is not None and bc.tp > 1 and not bc.sp:
        raise ValueError(
            f"parallel.tp={bc.tp} with a mixture-of-experts model needs parallel.sp=true "
            "(Megatron-Core's MoE layer takes the sequence-parallel token split at TP > 1)"
        )
    if moe is not None and bc.tp > 1 and bc.ep == 1:
        raise ValueError(
            f"parallel.tp={bc.tp} with a mixture-of-experts model needs parallel.ep > 1: at EP 1 "
            "Megatron-Core treats the (whole, expert TP 1) experts as dense weights and never sums "
            "the gradients each TP rank takes from its own tokens; spread them, e.g. parallel.ep=tp"
        )
    if bc.cp > 1 and arch.mrope:
        raise ValueError(
            f"parallel.cp with {arch.model_type}: context parallelism splits sequences by 1-D "
            "positions; use parallel.cp=1 for vision-language models"
        )
    if bc.sp and arch.mrope:
        raise ValueError(
            f"parallel.sp with {arch.model_type}: the image embeddings replace token rows of the "
            "full stream before the decoder; use parallel.sp=false for vision-language models"
        )
    dtype = getattr(torch, bc.dtype)
    on_gpu = torch.cuda.is_available() if bc.for_gpu is None else bc.for_gpu
    fp8 = {}
    if bc.precision == "fp8":
        fp8 = {"fp8": "hybrid", "fp8_recipe": bc.fp8_recipe}
    cfg = TransformerConfig(
        num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size,
        ffn_hidden_size=hf.intermediate_size,
        num_attention_heads=hf.num_attention_heads,
        num_query_groups=kv_heads,
        kv_channels=head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=hf.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=bc.tp,
        pipeline_model_parallel_size=bc.pp,
        virtual_pipeline_model_parallel_size=bc.vpp if bc.vpp > 1 else None,
        # interleaved: sends and receives one direction at a time (Megatron-LM's own rule; batched,
        # PP 2's two ranks would exchange activations and gradients in one batch, mismatched)
        overlap_p2p_comm=bc.vpp > 1,
        batch_p2p_comm=bc.vpp == 1,
        sequence_parallel=bc.sp,
        context_parallel_size=bc.cp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=bc.dtype == "bfloat16",
        use_cpu_initialization=not on_gpu,
        batch_p2p_sync=on_gpu,  # torch.cuda.synchronize after p2p: GPU only
        variable_seq_lengths=bc.pp > 1,  # packed micro-batches differ in length: send shapes first
        moe_token_dispatcher_type="alltoall",  # allgather refuses variable lengths
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        recompute_granularity="full" if bc.recompute else None,
        recompute_method="uniform" if bc.recompute else None,
        recompute_num_layers=1 if bc.recompute else None,
        **fp8,
        **_moe_fields(moe, bc),
    )
    kwargs = {
        "vocab_size": padded_vocab(hf.vocab_size, bc.vocab_multiple, bc.tp),
        "max_sequence_length": hf.max_position_embeddings,
        "position_embedding_type": "rope",
        "rotary_base": int(getattr(hf, "rope_theta", None) or hf.rope_parameters["rope_theta"]),
        "share_embeddings_and_output_weights": bool(getattr(hf, "tie_word_embeddings", False)),
    }
    # experts one module each (SequentialMLP), on either spec: the checkpoint names stay per expert
    experts = {"num_experts": moe.experts, "moe_grouped_gemm": False} if moe else {}
    if te_available() and not arch.mrope:  # mRoPE: the local spec's PackedRotary takes 3-row positions
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=arch.qk_norm, **experts)
    else:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        spec = get_gpt_layer_local_spec(qk_layernorm=arch.qk_norm, normalization="RMSNorm", **experts)
        if bc.sp:
            spec = _replace_module(spec, WrappedTorchNorm, SequenceParallelRMSNorm)
        if bc.cp > 1:
            from megatron.core.transformer.dot_product_attention import DotProductAttention

            spec = _replace_module(spec, DotProductAttention, context_parallel_attention())
    return cfg, kwargs, spec


_CP_ATTENTION: type | None = None


def context_parallel_attention() -> type:
    """The local spec's core attention under context parallelism: Megatron-Core's
    ``DotProductAttention`` built as at CP 1 (it refuses CP, which upstream only Transformer
    Engine's attention runs); the learner's ``PackedAttention`` computes it over every CP rank's
    keys and values (``agent_r1.learner.context_parallel``)."""
    global _CP_ATTENTION
    if _CP_ATTENTION is None:
        import dataclasses

        from megatron.core.transformer.dot_product_attention import DotProductAttention

        class ContextParallelDotProductAttention(DotProductAttention):
            def __init__(self, config: Any, *args: Any, **kwargs: Any):
                super().__init__(dataclasses.replace(config, context_parallel_size=1), *args, **kwargs)
                self.config = config

        _CP_ATTENTION = ContextParallelDotProductAttention
    return _CP_ATTENTION


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """The local spec's norm (torch's RMSNorm, as Megatron-Core's ``WrappedTorchNorm`` builds it)
    under sequence parallelism. ``WrappedTorchNorm`` refuses sequence parallelism because nothing
    marks its weight: each TP rank's gradient then covers only its slice of the tokens. Marked
    ``sequence_parallel``, Megatron's ``finalize_model_grads`` sums it over the TP ranks, as it
    does for Transformer Engine's and Apex's norms."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any):
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = bool(config.sequence_parallel)


def _replace_module(spec: Any, old: type, new: type) -> Any:
    """``spec`` (a Megatron ``ModuleSpec`` tree) with every use of the module class ``old`` by
    ``new``."""
    import dataclasses

    from megatron.core.transformer.spec_utils import ModuleSpec

    if spec is old:
        return new
    if not isinstance(spec, ModuleSpec):
        return spec
    sub = spec.submodules
    if dataclasses.is_dataclass(sub) and not isinstance(sub, type):
        sub = dataclasses.replace(
            sub, **{f.name: _replace_module(getattr(sub, f.name), old, new) for f in dataclasses.fields(sub)}
        )
    return dataclasses.replace(spec, module=new if spec.module is old else spec.module, submodules=sub)


def _moe_fields(moe: Any, bc: BridgeConfig) -> dict[str, Any]:
    """TransformerConfig's MoE fields for HF's router: softmax over every expert, the top k, their
    probabilities renormalised when ``norm_topk_prob`` (Megatron: top k of the logits, softmax over
    those k: the same numbers) or kept as they are (softmax first). Experts are not split by TP
    (expert TP 1): expert parallelism spreads whole experts over ranks instead."""
    if moe is None:
        return {}
    return {
        "num_moe_experts": moe.experts,
        "moe_ffn_hidden_size": moe.ffn,
        "moe_router_topk": moe.topk,
        "moe_router_pre_softmax": not moe.norm_topk,
        "moe_router_score_function": "softmax",
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": moe.aux_loss_coef,
        "expert_model_parallel_size": bc.ep,
        "expert_tensor_parallel_size": 1,
        "moe_permute_fusion": False,
    }


def build_gpt_chunks(hf: Any, bc: BridgeConfig) -> list[Any]:
    """This rank's model chunks: its pipeline stage, or with virtual pipeline stages (interleaved
    schedule) its ``bc.vpp`` stages in schedule order (model parallel state must be initialised)."""
    built = megatron_config(hf, bc)  # one TransformerConfig for every chunk, as Megatron shares it
    return [build_gpt_model(hf, bc, vp if bc.vpp > 1 else None, built) for vp in range(bc.vpp)]


def build_gpt_model(hf: Any, bc: BridgeConfig, vp_stage: int | None = None, built: Any = None):
    """This rank's pipeline stage of the GPTModel, or its virtual stage ``vp_stage`` (model
    parallel state must be initialised); ``built``: ``megatron_config``'s result to reuse."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    cfg, kwargs, spec = built or megatron_config(hf, bc)
    if cfg.num_moe_experts:
        _moe_without_te()
    if bc.sp and not te_available():  # the final norm too: the block's own default refuses SP
        from megatron.core.transformer.transformer_block import (
            TransformerBlockSubmodules,
            get_num_layers_to_build,
        )

        spec = TransformerBlockSubmodules(
            layer_specs=[spec] * get_num_layers_to_build(cfg, vp_stage), layer_norm=SequenceParallelRMSNorm
        )
    virtual = {} if vp_stage is None else {"vp_stage": vp_stage}
    return GPTModel(
        config=cfg,
        transformer_layer_spec=spec,
        pre_process=ps.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage),
        post_process=ps.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage),
        **virtual,
        **kwargs,
    )


def _moe_without_te() -> None:
    """megatron-core's router (0.16) reads ``moe_utils.te_general_gemm``, a name it defines only
    when Transformer Engine imports: without TE it is None, as the router's own fallback expects."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
