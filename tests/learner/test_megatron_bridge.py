"""Megatron-Core GPTModel built by megatron_bridge equals the HF model, at TP1/TP2/PP2/TP2xPP2,
for Llama, Qwen2 and Qwen3 (4 gloo ranks, one thread each), and exports back bit-identically."""

import json
from pathlib import Path

import pytest
import torch
from spawn import spawn_ranks

from agent_r1.models.tiny import build_tiny_model

WORKER = Path(__file__).with_name("megatron_worker.py")


def _perturbed(out: Path, arch: str, tied: bool) -> Path:
    """A tiny random model whose norms and biases are not at their init values (so a missed or
    swapped mapping shows in the logits)."""
    from safetensors.torch import load_file, save_file

    d = build_tiny_model(
        out,
        ["a b c d e f g h"] * 20,
        arch=arch,
        vocab_size=300,
        hidden=64,
        layers=4,
        heads=4,
        kv_heads=2,
        seed=3,
    )
    cfg = json.loads((d / "config.json").read_text())
    cfg["tie_word_embeddings"] = tied
    (d / "config.json").write_text(json.dumps(cfg))
    sd = load_file(str(d / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    for n, t in list(sd.items()):
        if t.dim() == 1:  # norms (and qwen2 biases)
            sd[n] = t + 0.1 * torch.randn(t.shape, generator=g)
    if not tied and "lm_head.weight" not in sd:
        sd["lm_head.weight"] = 0.02 * torch.randn(sd["model.embed_tokens.weight"].shape, generator=g)
    save_file(sd, str(d / "model.safetensors"))
    return d


@pytest.fixture(scope="module")
def bridge_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bridge")
    models = [
        _perturbed(tmp / "llama", "llama", tied=True),
        _perturbed(tmp / "qwen2", "qwen2", tied=False),
        _perturbed(tmp / "qwen3", "qwen3", tied=True),
    ]
    out = tmp / "results.json"
    spawn_ranks(WORKER, 4, ",".join(map(str, models)), "1x1,2x1,1x2,2x2", out, timeout=600)
    return json.loads(out.read_text())


def test_logits_match_hf_at_every_layout(bridge_results):
    assert len(bridge_results) == 12
    for r in bridge_results:
        assert r["max_logit_diff"] < 1e-4, r


def test_export_is_bit_identical_and_complete(bridge_results):
    for r in bridge_results:
        assert r["export_bit_identical"] and r["export_complete"], r


def test_fp8_fails_cleanly_on_cpu(tiny_model_dir):
    from transformers import AutoConfig

    from megatron_bridge import BridgeConfig, megatron_config

    with pytest.raises(RuntimeError, match="fp8 needs Transformer Engine and a CUDA GPU"):
        megatron_config(AutoConfig.from_pretrained(tiny_model_dir), BridgeConfig(precision="fp8"))
    with pytest.raises(ValueError, match="parallel.pp=3 must divide num_hidden_layers=2"):
        megatron_config(AutoConfig.from_pretrained(tiny_model_dir), BridgeConfig(pp=3))


def test_te_spec_name_mapping_round_trips():
    from megatron_bridge.weights import from_te_names, to_te_names

    sd = {
        "decoder.layers.3.input_layernorm.weight": 1,
        "decoder.layers.3.pre_mlp_layernorm.weight": 2,
        "decoder.final_layernorm.weight": 3,
    }
    te = to_te_names(sd)
    assert te == {
        "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight": 1,
        "decoder.layers.3.mlp.linear_fc1.layer_norm_weight": 2,
        "decoder.final_layernorm.weight": 3,
    }
    assert from_te_names(te) == sd
