"""Qwen3-MoE through the bridge: Megatron-Core's MoE layer (top-k softmax router, one module per
expert, the alltoall dispatcher) built from the HF config and loaded from the HF checkpoint's
per-expert tensors gives the HF model's logprobs on a packed, prefix-merged batch at one rank,
with the experts spread over two ranks (EP 2), at TP 2 with sequence parallelism (and EP 2) and
over two pipeline stages, and its gradients at one rank, at EP 2 and at TP 2 with sequence parallelism; the export gives back every HF tensor by name, the experts gathered to
the expert-parallel group's first rank."""

import json
from pathlib import Path

import pytest
from spawn import spawn_ranks

WORKER = Path(__file__).with_name("megatron_moe_worker.py")
# tp2sp: TP 2 with sequence parallelism, EP 2; pp2vpp2: two virtual stages on each of two ranks
LAYOUTS = ["1x1", "ep2", "tp2sp", "pp2", "pp2vpp2"]
SPREAD = ("ep2", "tp2sp")  # the layouts whose experts spread over two ranks


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3-MoE (8 experts, top 2, every layer sparse) with the usual tokenizer."""
    from agent_r1.models.tiny import build_tiny_model
    from recipes import load_recipe

    out = tmp_path_factory.mktemp("tiny") / "qwen3_moe"
    return build_tiny_model(  # four layers: two pipeline ranks of two virtual stages each
        out, load_recipe("arithmetic_tool").corpus(num=200), arch="qwen3_moe", vocab_size=400, layers=4
    )


@pytest.fixture(scope="module")
def moe_results(tiny_moe_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("moe") / "results.json"
    spawn_ranks(WORKER, 2, tiny_moe_dir, out, timeout=600)
    return json.loads(out.read_text())


def test_the_tiny_model_is_a_real_qwen3_moe(tiny_moe_dir: Path) -> None:
    from safetensors.torch import load_file

    cfg = json.loads((tiny_moe_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe" and cfg["num_experts_per_tok"] == 2
    names = load_file(f"{tiny_moe_dir}/model.safetensors")
    assert "model.layers.1.mlp.gate.weight" in names  # the router, as the public checkpoints name it
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in names  # one tensor set per expert


@pytest.mark.parametrize("layout", LAYOUTS)
def test_moe_logprobs_equal_hf(moe_results: dict, layout: str) -> None:
    assert moe_results[layout] < 1e-5  # against HF in float64, per step, unpacked


@pytest.mark.parametrize("layout", ["1x1", "ep2", "tp2sp"])
def test_moe_gradients_equal_hf(moe_results: dict, layout: str) -> None:
    """Layer 0's router and every expert's projections, after the backward of a weighted sum of
    the logprobs, against HF's autograd in float64 (the load-balancing loss off on both sides)."""
    assert moe_results[f"{layout}_grad_diff"] < 1e-5


@pytest.mark.parametrize("layout", LAYOUTS)
def test_experts_are_spread_over_the_expert_parallel_group(moe_results: dict, layout: str) -> None:
    assert moe_results[f"{layout}_local_experts"] == (4 if layout in SPREAD else 8)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_export_gives_back_every_hf_tensor(moe_results: dict, layout: str) -> None:
    assert moe_results[f"{layout}_export_names"]
    assert moe_results[f"{layout}_export_diff"] == 0.0
    # at EP 2 the experts are gathered to the group's first rank only (not held by every rank)
    assert moe_results[f"{layout}_expert_holders"] == (1 if layout in SPREAD else 2)


def test_the_bridge_refuses_what_it_cannot_map(tiny_moe_dir: Path, tiny_model_dir: Path) -> None:
    from transformers import AutoConfig

    from megatron_bridge import BridgeConfig
    from megatron_bridge.config import megatron_config

    moe = AutoConfig.from_pretrained(tiny_moe_dir)
    with pytest.raises(ValueError, match=r"parallel.ep=3 must divide the model's experts \(8\)"):
        megatron_config(moe, BridgeConfig(ep=3))
    with pytest.raises(ValueError, match="parallel.ep=2 needs a mixture-of-experts model; qwen3 is dense"):
        megatron_config(AutoConfig.from_pretrained(tiny_model_dir), BridgeConfig(ep=2))
    with pytest.raises(
        ValueError, match=r"parallel.tp=2 with a mixture-of-experts model needs parallel.sp=true"
    ):
        megatron_config(moe, BridgeConfig(tp=2, ep=2))
    with pytest.raises(
        ValueError, match=r"parallel.tp=2 with a mixture-of-experts model needs parallel.ep > 1"
    ):
        megatron_config(moe, BridgeConfig(tp=2, sp=True))
    with pytest.raises(ValueError, match=r"parallel.sp needs parallel.tp > 1"):
        BridgeConfig(sp=True)
    moe.mlp_only_layers = [0]
    with pytest.raises(ValueError, match=r"every layer must be sparse .* mlp_only_layers=\[0\]"):
        megatron_config(moe, BridgeConfig())


ACTOR = Path(__file__).with_name("megatron_moe_actor_worker.py")


@pytest.fixture(scope="module")
def moe_actor(tiny_moe_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    d = tmp_path_factory.mktemp("moe_actor")
    spawn_ranks(ACTOR, 2, tiny_moe_dir, d / "ckpt", d / "results.json", timeout=600)
    return json.loads((d / "results.json").read_text())


def test_ppo_steps_at_ep2_reduce_the_loss(moe_actor: dict) -> None:
    losses = moe_actor["losses"]
    assert moe_actor["local_experts"] == 4 and losses[-1] < losses[0] - 0.05, losses


@pytest.mark.parametrize("layout", ["ep2", "ep1", "tp2sp", "pp2", "pp2vpp2"])
def test_an_ep2_checkpoint_resumes_at_another_layout(moe_actor: dict, layout: str) -> None:
    """Saved with the experts over two ranks; loaded there, with every expert on each rank, at
    TP 2 with sequence parallelism, over two pipeline stages and over two ranks of two virtual
    stages each: the same loss on the same batch (Megatron's dist_checkpointing reshards the
    experts, the tensor-parallel weights and the layers over (virtual) stages)."""
    assert moe_actor[f"resumed_{layout}"] == pytest.approx(moe_actor["saved"], abs=1e-6)


@pytest.mark.parametrize("layout", ["tp2sp", "pp2vpp2"])
def test_a_step_at_another_layout_has_the_data_parallel_gradient(moe_actor: dict, layout: str) -> None:
    """From the same checkpoint, the gradient of a PPO step at TP 2 with sequence parallelism and
    through the interleaved schedule of two virtual stages per pipeline rank has the norm of the
    one at DP 2 (each DP rank with the whole batch): with sequence parallelism the gradients of
    the norms and the router, each TP rank's for its half of the tokens, are summed over the TP
    group before the step (counted once in the norm). (The losses after one Adam step are no
    check: its first update is lr * sign(gradient), which turns float noise in a near-zero
    gradient into a whole step.)"""
    assert moe_actor[f"grad_norm_{layout}"] == pytest.approx(moe_actor["grad_norm_ep1"], rel=1e-5)
