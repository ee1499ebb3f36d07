"""The Megatron policy learner trains (loss falls on a fixed batch at DP2/TP2/PP2), checkpoints
atomically, and resumes at another TP/PP layout with the identical next-step loss."""

import json
from pathlib import Path

import pytest
from spawn import spawn_ranks

WORKER = Path(__file__).with_name("megatron_actor_worker.py")


@pytest.fixture(scope="module")
def actor_results(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("actor")
    out = tmp / "results.json"
    spawn_ranks(WORKER, 2, tiny_model_dir, tmp / "ckpt", out)
    assert (tmp / "ckpt" / "agent_r1_state.json").exists() and not (tmp / "ckpt.tmp").exists()
    return json.loads(out.read_text())


@pytest.mark.parametrize("key", ["dp2_losses", "losses_2x1", "losses_1x2"])
def test_optimizer_steps_reduce_the_loss(actor_results, key):
    losses = actor_results[key]
    assert losses[-1] < losses[0] - 1e-3, losses


def test_metrics(actor_results):
    m = actor_results["dp2_metrics"]
    assert m["grad_norm"] > 0 and m["lr"] > 0 and 0 <= m["clipfrac"] <= 1


def test_checkpoint_resumes_same_layout_and_other_layouts(actor_results):
    saved = actor_results["next_loss_saved"]
    assert actor_results["trainer_state"] == {"data_cursor": 7}
    assert actor_results["next_loss_reloaded_same_layout"] == pytest.approx(saved, abs=1e-6)
    a, b = actor_results["after_step_same"]  # optimizer state restored too: the next update matches
    assert a == pytest.approx(b, abs=1e-6)
    for layout in ("2x1", "1x2"):
        assert actor_results[f"next_loss_{layout}"] == pytest.approx(saved, abs=1e-5), layout


def test_optimizer_state_survives_the_checkpoint_and_adam_is_fused(actor_results):
    saved, reloaded = actor_results["opt_state"]
    assert saved[:4] == pytest.approx(reloaded[:4], rel=1e-6) and saved[1] >= 1  # lr, step, moments
    assert saved[4] and reloaded[4]  # torch's fused Adam kernel, also after loading a checkpoint
