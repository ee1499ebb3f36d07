"""Tiny HF models for CPU tests and the quickstart: random init, a byte-level BPE tokenizer
trained on a recipe's text, and a chat template with tool markup — ChatML (default), Llama 3 or
Harmony (``chat_format``), the Jinja template rendering exactly what that format's codec encodes.
Saved as a normal HF folder (``config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json``). ``arch="qwen2_vl"`` / ``"qwen2_5_vl"`` builds a vision-language model of the Qwen2-VL
family (a small vision tower, multimodal rotary sections; ChatML with the vision tokens) and saves
its image processor too (``preprocessor_config.json``: ``AutoProcessor`` loads the folder).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from agent_r1.agent.chat import CHAT_FORMATS, VISION_TOKENS

ARCHS = ("qwen3", "qwen3_moe", "qwen2", "llama", "qwen2_vl", "qwen2_5_vl")
VISION_ARCHS = ("qwen2_vl", "qwen2_5_vl")
# the tiny VLM's image sizes: 4 to 16 vision tokens per image (28x28 pixels each after merging)
TINY_MIN_PIXELS, TINY_MAX_PIXELS = 56 * 56, 112 * 112


def train_tokenizer(
    texts: list[str],
    vocab_size: int = 1024,
    chat_format: str = "chatml",
    vision: bool = False,
    split_digits: bool = False,
) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if split_digits:  # one token per digit, as Qwen2's and Llama 3's tokenizers split numbers
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    tok.decoder = decoders.ByteLevel()
    fmt = CHAT_FORMATS[chat_format]
    specials = list(fmt.SPECIAL_TOKENS) + (list(VISION_TOKENS) if vision else [])
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    named = {fmt.EOS, fmt.PAD, fmt.BOS}
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=fmt.EOS,
        pad_token=fmt.PAD,
        bos_token=fmt.BOS,
        additional_special_tokens=[t for t in specials if t not in named],
        chat_template=fmt.JINJA,
        model_max_length=2048,
    )


def model_config(
    arch: str,
    vocab_size: int,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    max_positions: int,
    **ids: int,
) -> Any:
    import transformers as tf

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        **ids,
    )
    if arch == "qwen3":
        return tf.Qwen3Config(head_dim=hidden // heads, **common)
    if arch == "qwen3_moe":  # every layer sparse: 8 experts of hidden width, top 2, renormalised
        return tf.Qwen3MoeConfig(
            head_dim=hidden // heads, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=hidden,
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001,
            **common,
        )  # fmt: skip
    if arch == "qwen2":
        return tf.Qwen2Config(**common)
    if arch == "llama":
        return tf.LlamaConfig(head_dim=hidden // heads, **common)
    if arch in VISION_ARCHS:
        half = hidden // heads // 2  # rotary pairs per head, split over (time, height, width)
        text = {k: v for k, v in common.items() if k != "rope_theta"}
        text["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [half - 2 * (half * 3 // 8), half * 3 // 8, half * 3 // 8],
        }
        geometry = dict(patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
        if arch == "qwen2_vl":
            vision = dict(depth=2, embed_dim=32, hidden_size=hidden, num_heads=2, mlp_ratio=2, **geometry)
            return tf.Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)
        # Qwen2.5-VL's tower: RMSNorm, SwiGLU, window attention but in the last block
        vision = dict(
            depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden,
            window_size=56, fullatt_block_indexes=[1], **geometry,
        )  # fmt: skip
        return tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)
    raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")


def build_tiny_model(
    out: str | Path,
    texts: list[str],
    tools: list[dict[str, Any]] | None = None,
    arch: str = "qwen3",
    vocab_size: int = 1024,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    max_positions: int = 2048,
    seed: int = 0,
    chat_format: str = "chatml",
    split_digits: bool = False,
) -> Path:
    """Train the tokenizer on ``texts`` (plus chat/tool markup), build and save a random model."""
    from transformers import AutoModelForCausalLM

    if chat_format not in CHAT_FORMATS:
        raise ValueError(f"chat_format must be one of {sorted(CHAT_FORMATS)}, got {chat_format!r}")
    vision = arch in VISION_ARCHS
    if vision and chat_format != "chatml":
        raise ValueError(f"arch {arch!r} speaks ChatML with vision tokens, not {chat_format!r}")
    fmt = CHAT_FORMATS[chat_format]
    render = fmt.__new__(fmt)  # rendering needs no tokenizer
    chat = [render.render_prefix(None, tools), render.render_message("assistant", "ok")]
    out = Path(out)
    tokenizer = train_tokenizer(list(texts) + chat * 10, vocab_size, chat_format, vision, split_digits)
    ids = dict(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if vision:
        vocab = tokenizer.get_vocab()
        ids |= dict(
            image_token_id=vocab["<|image_pad|>"],
            video_token_id=vocab["<|video_pad|>"],
            vision_start_token_id=vocab["<|vision_start|>"],
            vision_end_token_id=vocab["<|vision_end|>"],
        )
    cfg = model_config(arch, len(tokenizer), hidden, layers, heads, kv_heads, max_positions, **ids)
    torch.manual_seed(seed)
    if vision:
        import transformers as tf

        cls = (
            tf.Qwen2VLForConditionalGeneration
            if arch == "qwen2_vl"
            else tf.Qwen2_5_VLForConditionalGeneration
        )
        model = cls._from_config(cfg, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if arch == "qwen3_moe":  # a decisive router (HF's 0.02 makes every expert's score a near tie)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.gate.weight.normal_(0.0, 1.0 / hidden**0.5)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if vision:
        save_image_processor(out)
    return out


def save_image_processor(
    out: Path, min_pixels: int = TINY_MIN_PIXELS, max_pixels: int = TINY_MAX_PIXELS
) -> None:
    """The Qwen2-VL image processor's config (``preprocessor_config.json``) for the tiny VLM."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    proc = Qwen2VLImageProcessorPil(size={"shortest_edge": min_pixels, "longest_edge": max_pixels})
    proc.save_pretrained(out)
