"""True on-policy in deterministic mode: the learner's logprobs of actions the batch-invariant
engine sampled are the engine's float32 bits (its ``Scorer`` as their values, Megatron's forward for
their gradients), before and after a weight update; without it they differ in the last bits."""

import json
from pathlib import Path

import pytest
from spawn import spawn_ranks

WORKER = Path(__file__).with_name("megatron_exact_logprobs_worker.py")


@pytest.fixture(scope="module")
def results(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("exact") / "results.json"
    spawn_ranks(WORKER, 1, tiny_model_dir, out, timeout=600)
    return json.loads(out.read_text())


def test_the_learner_recomputes_the_engines_logprobs_bit_for_bit(results):
    assert results["micro_batches"] > 1  # several packed micro-batches of prefix-merged episodes
    assert results["exact_equal"] == 1.0
    assert results["after_update_equal"] == 1.0  # the pushed weights: the learner's copy followed
    assert results["old_batch_changed"] > 0.9


def test_shared_prefixes_get_the_engines_bits_too(results):
    assert results["shared_branches"] >= 4  # each prompt's second sample continues its first
    assert results["shared_exact_equal"] == 1.0


def test_without_the_engines_kernels_they_differ_in_the_last_bits(results):
    assert results["plain_equal"] < 0.9  # the same function, its sums in another order
    assert 0 < results["plain_max_diff"] < 1e-5


def test_every_first_pass_ratio_is_exactly_one_and_the_gradient_is_megatrons(results):
    assert results["exact_ratio_dev"] == 0.0 and results["plain_ratio_dev"] > 0.0
    e, p = results["exact_step"], results["plain_step"]
    assert e["approx_kl"] == 0.0 and e["clipfrac"] == 0.0
    assert e["grad_norm"] == pytest.approx(p["grad_norm"], rel=1e-4)  # gradients through Megatron
