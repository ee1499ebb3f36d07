"""Critic (value head on the Megatron backbone) and frozen reference policy."""

import json
from pathlib import Path

import pytest
from spawn import spawn_ranks

WORKER = Path(__file__).with_name("megatron_critic_worker.py")


@pytest.fixture(scope="module")
def critic_results(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("critic") / "results.json"
    spawn_ranks(WORKER, 2, tiny_model_dir, out)
    return json.loads(out.read_text())


@pytest.mark.parametrize("layout", ["1x1", "2x1", "1x2"])
def test_value_regression_and_prefix_merged_values(critic_results, layout):
    losses = critic_results[f"value_losses_{layout}"]
    assert losses[-1] < 0.7 * losses[0], losses
    assert critic_results[f"values_nonzero_{layout}"] > 1e-3  # the head learned something
    assert critic_results[f"value_merge_diff_{layout}"] < 1e-5


@pytest.mark.parametrize("layout", ["1x1", "2x1", "1x2"])
def test_critic_checkpoint_resumes(critic_results, layout):
    assert critic_results[f"resume_value_diff_{layout}"] < 1e-6  # the value head and backbone came back
    a, b = critic_results[f"resume_next_loss_{layout}"]  # and the optimizer state: the same next step
    assert a == pytest.approx(b, abs=1e-6)


@pytest.mark.parametrize("layout", ["1x1", "2x1", "1x2"])
def test_reference_policy_equals_initial_actor(critic_results, layout):
    assert critic_results[f"ref_diff_{layout}"] < 1e-6


def test_sequence_parallel_values_and_gradient_equal_plain_tensor_parallel(critic_results):
    """TP 2 with sequence parallelism: the value head sees the stream gathered from the two
    halves (its gradient handed back split); the values after two steps (the second moves the
    backbone, the norms by their gradients summed over the two halves) and the next step's
    gradient norm equal TP 2 without it."""
    plain, split = critic_results["sp0_values"], critic_results["sp1_values"]
    assert max(abs(a) for a in plain) > 1e-3  # the head moved off zero
    assert max(abs(a - b) for a, b in zip(plain, split, strict=True)) < 1e-5
    assert critic_results["sp1_grad_norm"] == pytest.approx(critic_results["sp0_grad_norm"], rel=1e-5)
