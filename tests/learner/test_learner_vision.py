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


@pytest.mark.parametrize("layout", ["1x1", "2x1", "1x2"])
def test_packed_logprobs_with_images_equal_hf(vl_results, layout):
    assert vl_results[layout] < 1e-5


@pytest.mark.parametrize("layout", ["1x1", "2x1", "1x2"])
def test_weight_export_round_trip_keeps_checkpoint_names(vl_results, layout):
    assert vl_results[f"{layout}_export_names"]  # language model + visual.*, every tensor, nothing else
    assert vl_results[f"{layout}_export_diff"] == 0.0


def test_the_images_are_used(vl_results):
    assert vl_results["without_images_diff"] > 1e-3
    assert "has images but the learner has no vision tower" in vl_results["no_tower_error"]
