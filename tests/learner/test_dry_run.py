"""The learner's dry run (``agent-r1 plan``'s engine): its accounting against the same update on
real CPU tensors, and what it must refuse (a host tensor in the loss path, a whole-world gather in
the weight push). Each measurement runs in its own process: a dry run patches torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("dry_run_worker.py")
NCCL = ("parallel.backend=nccl", "cluster=slurm_gpu")  # the config refuses NCCL under the local launcher
PP2 = ("parallel.learner_ranks=4", "parallel.pp=2")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Big enough that tensors, not bookkeeping, make up the memory (hidden 256, vocab 800)."""
    from agent_r1.models.tiny import build_tiny_model
    from recipes import load_recipe

    out = tmp_path_factory.mktemp("dryrun") / "qwen3"
    texts = load_recipe("arithmetic_tool").corpus(num=200)
    return build_tiny_model(
        out, texts, arch="qwen3", vocab_size=800, hidden=256, layers=2, heads=4, kv_heads=2
    )


def overrides(model: Path) -> list[str]:
    return [
        f"model.path={model}",
        "rollout.group_size=4",
        "rollout.prompts_per_iteration=4",
        "episode.max_steps=2",
        "episode.max_obs_tokens=96",
        "episode.max_action_tokens=32",
        "optim.micro_tokens=512",
        "algorithm=ppo",  # a critic too: three models' worth of state
    ]


def measure(mode: str, model: Path, tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / f"{mode}.json"
    proc = subprocess.run(
        [sys.executable, str(WORKER), mode, str(out), *overrides(model), *extra],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_accounting_matches_real_tensors(model_dir: Path, tmp_path: Path) -> None:
    """The same update on real CPU tensors (each storage the allocator handed out, counted while
    alive) and as a dry run with the CPU's kernels: every term within 10 %."""
    real = measure("real", model_dir, tmp_path)
    dry = measure("dry", model_dir, tmp_path)
    assert real.get("error") is None, real
    assert dry.get("error") is None, dry
    for key in ("weights", "grads", "optimizer", "activations"):
        assert real[key] > 0, (key, real)
        assert abs(dry[key] - real[key]) <= 0.10 * real[key], (key, dry[key], real[key])
    assert dry["weights"] == dry["grads"]  # fp32 params, fp32 gradient buffers
    # three schedules (critic values, actor and critic updates) of four micro-batches each: the
    # dry run ran each over its two largest (pp + 1), the real update over all
    assert dry["microbatches"] == 12 and dry["max_microbatch_tokens"] <= 512


def test_the_largest_pp_plus_one_micro_batches_reach_the_whole_schedules_peak(
    model_dir: Path, tmp_path: Path
) -> None:
    """Stage 0 of PP 2 (it holds the most micro-batches in flight) over eight micro-batches per
    schedule: the plan's three against every one gives the same state and an activation peak
    within 1 %."""
    more = (*NCCL, *PP2, "optim.micro_tokens=256", "rollout.prompts_per_iteration=8")
    steady = measure("dry", model_dir, tmp_path, *more)
    every = measure("dry_every", model_dir, tmp_path, *more)
    assert steady.get("error") is None and every.get("error") is None, (steady, every)
    assert steady["microbatches"] == every["microbatches"] == 24
    assert steady["collectives"] < every["collectives"]  # fewer micro-batches did run
    for key in ("weights", "grads", "optimizer", "push"):
        assert steady[key] == every[key], key
    assert 0.99 * every["activations"] <= steady["activations"] <= every["activations"], (steady, every)


def test_a_host_tensor_in_the_loss_path_is_caught(model_dir: Path, tmp_path: Path) -> None:
    got = measure("plant_cpu_tensor", model_dir, tmp_path, *NCCL)
    assert got.get("error"), got
    assert "cpu" in got["error"] and "meta" in got["error"], got
    assert "dry_run_worker.py" in got["where"] and "policy_loss" in got["where"], got  # the planted line


def test_a_whole_world_gather_in_the_push_is_caught(model_dir: Path, tmp_path: Path) -> None:
    got = measure("plant_world_gather", model_dir, tmp_path, *NCCL, *PP2)
    assert got.get("error"), got
    assert "whole world" in got["error"] and "gather_object" in got["error"], got
    assert "dry_run_worker.py" in got["error"], got  # names the code that gathered


def test_the_point_to_point_push_passes(model_dir: Path, tmp_path: Path) -> None:
    """The learner's own push at PP 2 over NCCL: no error, rank 0 receives the other stage."""
    got = measure("dry", model_dir, tmp_path, *NCCL, *PP2)
    assert got.get("error") is None, got
    assert got["push_bytes"] > 0 and got["collectives"] > 0
