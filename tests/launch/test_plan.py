"""``agent-r1 plan`` on every GPU preset (each stage dry-run in its own process on fake GPUs), the
accounting against an independent count of the model's parameters, and ``agent-r1 launch``
refusing a run the plan says does not fit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRESETS = sorted(p.stem for p in (ROOT / "configs" / "experiment").glob("*_[0-9]n8g.yaml"))
MOE = {"a3b": 4, "a22b": 2}  # the mixture-of-experts presets (H200s) and their pipeline stages


def _moe(preset: str) -> str | None:
    return next((k for k in MOE if f"_{k}_" in preset), None)


GiB = 1 << 30


def agent_r1(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "agent_r1.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


@pytest.fixture(scope="module")
def plans() -> dict[str, dict]:
    out = {}
    for preset in PRESETS:
        proc = agent_r1("plan", f"+experiment={preset}", "--json")
        assert proc.stdout.strip().startswith("{"), proc.stdout[-2000:] + proc.stderr[-3000:]
        out[preset] = json.loads(proc.stdout) | {"returncode": proc.returncode}
    return out


def test_there_are_gpu_presets() -> None:
    assert len(PRESETS) >= 5, PRESETS


@pytest.mark.parametrize("preset", PRESETS)
def test_every_gpu_preset_fits_its_gpus(plans: dict[str, dict], preset: str) -> None:
    """80 GB GPUs (H100, A100), except the mixture-of-experts presets' H200s (their experts' fp32
    gradients and Adam moments, and the dispatched tokens' activations)."""
    p = plans[preset]
    assert p["returncode"] == 0 and p["fits"], json.dumps(p, indent=1)[:3000]
    moe = _moe(preset)
    assert p["gpu_mem"] == (141 if moe else 80) * GiB
    assert len(p["stages"]) == p["pp"] == (MOE[moe] if moe else 2)
    for s in p["stages"]:
        assert s["error"] is None, s
        assert s["total"] <= p["gpu_mem"], s
        for key in ("weights", "grads", "optimizer", "activations", "push"):
            assert s[key] > 0, (key, s)
        assert s["microbatches"] > 0 and s["collectives"] > 0
        # every packed stream at FP8's alignment when the preset trains in FP8
        if s["fp8_weights"]:
            assert s["max_microbatch_tokens"] % 16 == 0, s
    r = p["rollout"]
    assert r["push_bytes"] == max(s["push_bytes"] for s in p["stages"]) > 0
    # what streaming would buy on the preset's GPUs (the model itself: test_projection.py)
    rate = {o["mode"]: o["steps_per_s"] for o in p["projection"]}
    assert set(rate) == {"sync", "one_step_off", "stream_eta1", "stream_eta2", "stream_eta4"}
    assert rate["stream_eta4"] >= rate["stream_eta1"] >= rate["sync"] > 0
    assert r["episodes_per_server"] >= 1 and r["kv_tokens"] >= r["episode_tokens"]


def _qwen3_4b_stage1_params() -> tuple[int, int]:
    """(actor, critic) parameters per TP rank on the last of two pipeline stages, counted from
    Qwen3-4B's public config: 18 decoder layers, the final norm, and the output layer (the actor:
    the padded vocabulary, split over TP 2) or the value head (the critic)."""
    cfg = json.loads((ROOT / "configs/model/hf/Qwen3-4B/config.json").read_text())
    H, F, D = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    nq, nkv, L, V = (
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["num_hidden_layers"],
        cfg["vocab_size"],
    )
    tp, layers = 2, L // 2
    vocab = -(-V // (128 * tp)) * 128 * tp
    split = layers * (H * nq * D + 2 * H * nkv * D + nq * D * H + 3 * H * F) // tp
    replicated = layers * (2 * H + 2 * D) + H  # two norms + q/k norms per layer, the final norm
    return split + replicated + vocab * H // tp, split + replicated + H + 1


def test_the_plan_counts_the_models_parameters(plans: dict[str, dict]) -> None:
    """StepPO trains an actor and a critic (no reference): the last stage's weights are both
    models' bf16 parameters, their gradient buffers fp32 (Megatron reduces gradients in fp32)."""
    last = plans["qwen3_4b_gsm8k_tool_steppo_4n8g"]["stages"][1]
    actor, critic = _qwen3_4b_stage1_params()
    assert abs(last["weights"] - 2 * (actor + critic)) <= 0.01 * last["weights"], (last, actor, critic)
    assert abs(last["grads"] - 4 * (actor + critic)) <= 0.01 * last["grads"], (last, actor, critic)
    # distributed optimizer: fp32 main weights + two Adam moments, sharded over DP 8
    assert abs(last["optimizer"] - 12 * (actor + critic) / 8) <= 0.15 * last["optimizer"], last


def test_launch_refuses_a_run_that_does_not_fit(tmp_path: Path) -> None:
    proc = agent_r1(
        "launch",
        "+experiment=qwen3_4b_paper_search_pspo_4n8g",
        "cluster.gpu_mem_gb=40",
        f"trainer.run_dir={tmp_path / 'run'}",
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    err = proc.stderr
    assert "does not fit" in err and "--no-plan" in err, err[-3000:]
    assert "stage 0 needs" in err and "lower optim.micro_tokens" in err, err[-3000:]
    assert not (tmp_path / "run" / "job.sbatch").exists()  # nothing submitted, nothing written


def test_the_moe_preset_spreads_its_experts(plans: dict[str, dict]) -> None:
    """Qwen3-30B-A3B at PP 4, EP 8: each GPU holds 16 of 128 experts of its 12 layers, so the
    last stage's bf16 weights are its share of the experts plus the dense parts (attention,
    routers, norms; the output layer), counted from the public config."""
    cfg = json.loads((ROOT / "configs/model/hf/Qwen3-30B-A3B/config.json").read_text())
    H, D, F, E = cfg["hidden_size"], cfg["head_dim"], cfg["moe_intermediate_size"], cfg["num_experts"]
    nq, nkv, V, layers = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"], 12
    attention = H * nq * D * 2 + 2 * H * nkv * D + 2 * D + 2 * H  # q, o, k, v, q/k norms, 2 norms
    experts = (E // 8) * 3 * H * F
    actor = layers * (attention + E * H + experts) + H + V * H
    critic = layers * (attention + E * H + experts) + H + H + 1  # the value head in place of the vocabulary
    last = [p for name, p in plans.items() if "a3b" in name][0]["stages"][3]
    assert abs(last["weights"] - 2 * (actor + critic)) <= 0.01 * last["weights"], (last, actor, critic)


def test_the_235b_layout_holds_a_quarter_of_the_dense_weights_and_four_experts(
    plans: dict[str, dict],
) -> None:
    """Qwen3-235B-A22B at PP 2, TP 4, EP 32: the last stage's bf16 weights per GPU are its 47
    layers' attention split over TP 4, their routers and norms whole, 4 of 128 experts of each
    layer whole (expert TP 1), and a quarter of the output layer (GSPO: no critic, no reference);
    and the push moves the whole model (470 GB) through rank 0's host memory while its GPU holds
    a few GiB."""
    cfg = json.loads((ROOT / "configs/model/hf/Qwen3-235B-A22B/config.json").read_text())
    H, D, F, E = cfg["hidden_size"], cfg["head_dim"], cfg["moe_intermediate_size"], cfg["num_experts"]
    nq, nkv, V, L = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"], 94
    layers, tp = L // 2, 4
    attention = (H * nq * D * 2 + 2 * H * nkv * D) // tp + 2 * D + 2 * H  # q, o, k, v split; norms whole
    experts = (E // 32) * 3 * H * F
    vocab = -(-V // (128 * tp)) * 128 * tp
    actor = layers * (attention + E * H + experts) + H + vocab * H // tp
    plan = plans["qwen3_235b_a22b_gsm8k_tool_gspo_8n8g"]
    last = plan["stages"][1]
    assert abs(last["weights"] - 2 * actor) <= 0.01 * last["weights"], (last, actor)
    total = 2 * (
        L * (H * nq * D * 2 + 2 * H * nkv * D + 2 * D + 2 * H + E * H + E * 3 * H * F) + H + 2 * V * H
    )
    assert abs(plan["rollout"]["push_bytes"] - total) <= 0.01 * total, (plan["rollout"], total)
    assert max(s["push"] for s in plan["stages"]) < 10 * GiB  # one tensor (and one bucket) at a time


def test_virtual_stages_are_planned_through_the_interleaved_schedule(plans: dict[str, dict]) -> None:
    """Qwen3-4B's preset with two virtual stages per pipeline rank: every stage's dry run runs
    Megatron's interleaved schedule (the activations received in its order of virtual
    micro-batches), and the first stage, which warms up with more micro-batches in flight, plans
    more activation memory than under 1F1B, on the same weights."""
    vpp, plain = _beside_the_4b_plan(plans, "parallel.vpp=2")
    assert vpp[0]["activations"] > plain[0]["activations"]


def _beside_the_4b_plan(plans: dict[str, dict], *overrides: str) -> tuple[list[dict], list[dict]]:
    """The Qwen3-4B preset's stages planned with ``overrides``, and without (same weights, no
    error)."""
    preset = "qwen3_4b_gsm8k_tool_steppo_4n8g"
    proc = agent_r1("plan", f"+experiment={preset}", *overrides, "--json")
    assert proc.stdout.strip().startswith("{"), proc.stdout[-2000:] + proc.stderr[-3000:]
    other, plain = json.loads(proc.stdout)["stages"], plans[preset]["stages"]
    for s, t in zip(other, plain, strict=True):
        assert s["error"] is None, s
        assert s["weights"] == t["weights"]
    return other, plain


def test_context_parallelism_halves_a_stages_activations(plans: dict[str, dict]) -> None:
    """Qwen3-4B's preset at CP 2 (the same 32 GPUs: DP 4): each CP rank holds half of every
    sequence, so each stage's activations are about half of CP 1's, on the same weights."""
    cp, plain = _beside_the_4b_plan(plans, "parallel.cp=2")
    for s, t in zip(cp, plain, strict=True):
        assert 0.4 * t["activations"] < s["activations"] < 0.65 * t["activations"], (s, t)
