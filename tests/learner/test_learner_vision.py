"""The learner on a Qwen2-VL-family model: Megatron's language model with multimodal rotary
positions and the vision tower's embeddings in place of the image pads (``megatron_vl_worker.py``)."""

import json
from pathlib import Path

import pytest
from spawn import spawn_ranks

WORKER = Path(__file__).with_name("megatron_vl_worker.py")


@pytest.fixture(scope="module")
def vl_results(tiny_vl_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("vl") / "results.json"
    spawn_ranks(WORKER, 2, tiny_vl_dir, out, timeout=600)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def vl25_results(tiny_vl25_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("vl25") / "results.json"
    spawn_ranks(WORKER, 2, tiny_vl25_dir, out, timeout=600)
    return json.loads(out.read_text())


@pytest.mark.parametrize("layout", ["1x1", "2x1", "1x2"])
def test_packed_logprobs_with_images_equal_hf(vl_results, layout):
    assert vl_results[layout] < 1e-5


@pytest.mark.parametrize("layout", ["1x1", "2x1", "1x2"])
def test_qwen2_5_vl_packed_logprobs_equal_hf(vl25_results, layout):
    assert vl25_results[layout] < 1e-5 and vl25_results[f"{layout}_export_diff"] == 0.0


@pytest.mark.parametrize("layout", ["1x1", "2x1", "1x2"])
def test_weight_export_round_trip_keeps_checkpoint_names(vl_results, layout):
    assert vl_results[f"{layout}_export_names"]  # language model + visual.*, every tensor, nothing else
    assert vl_results[f"{layout}_export_diff"] == 0.0


def test_the_images_are_used(vl_results):
    assert vl_results["without_images_diff"] > 1e-3
    assert "has images but the learner has no vision tower" in vl_results["no_tower_error"]


ACTOR = Path(__file__).with_name("megatron_vl_actor_worker.py")


@pytest.fixture(scope="module")
def vl_actor(tiny_vl_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("vl_actor")
    spawn_ranks(ACTOR, 2, tiny_vl_dir, d / "ckpt", d / "results.json", timeout=600)
    return json.loads((d / "results.json").read_text())


def test_records_with_images_through_the_actor_equal_hf(vl_actor):
    assert vl_actor["merged"]  # the two steps of a trajectory are one packed sequence
    assert vl_actor["frozen_vs_hf"] < 1e-5 and vl_actor["trained_vs_hf"] < 1e-5


@pytest.mark.parametrize("key", ["frozen", "trained"])
def test_ppo_steps_with_images(vl_actor, key):
    losses = vl_actor[f"{key}_losses"]
    assert losses[-1] < losses[0] - 1e-3
    assert vl_actor[f"{key}_tower_same_on_dp_ranks"]


def test_the_tower_is_frozen_by_default_and_trains_as_an_option(vl_actor):
    assert vl_actor["frozen_tower_moved"] == 0.0 and not vl_actor["frozen_exports_visual"]
    assert vl_actor["trained_tower_moved"] > 1e-4 and vl_actor["trained_exports_visual"]


@pytest.mark.parametrize("layout", ["2x1", "1x2"])
def test_checkpoint_with_the_tower_resumes_at_other_layouts(vl_actor, layout):
    assert abs(vl_actor[f"next_loss_{layout}"] - vl_actor["next_loss_saved"]) < 1e-5
    assert vl_actor[f"tower_restored_{layout}"] == 0.0
