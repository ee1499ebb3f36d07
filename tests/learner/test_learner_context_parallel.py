"""Context parallelism on 2 gloo ranks (``agent_r1.learner.context_parallel``): every sequence of a
packed micro-batch split over the CP ranks in Transformer Engine's THD layout, attention over
every rank's keys; the actor's logprobs against HF, its gradient and the critic's against the
same updates without CP, and a CP checkpoint resumed without it."""

import json
from pathlib import Path

import pytest
from spawn import spawn_ranks

WORKER = Path(__file__).with_name("megatron_cp_worker.py")


@pytest.fixture(scope="module")
def cp_results(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    d = tmp_path_factory.mktemp("cp")
    spawn_ranks(WORKER, 2, tiny_model_dir, d / "ckpt", d / "results.json", timeout=600)
    return json.loads((d / "results.json").read_text())


def test_each_rank_holds_half_of_every_padded_sequence(cp_results: dict) -> None:
    assert cp_results["micro_batches"] > 1
    for rows, n in zip(cp_results["cp2_rows"], cp_results["cp2_stream"], strict=True):
        assert n / 2 <= rows < n / 2 + 2 * 8  # each sequence padded to a multiple of 4 rows


@pytest.mark.parametrize("cp", [1, 2])
def test_logprobs_equal_hf(cp_results: dict, cp: int) -> None:
    assert cp_results[f"cp{cp}_lp_diff"] < 1e-5  # against HF in float64, per step, unpacked


def test_a_cp2_step_has_the_dp2_gradient(cp_results: dict) -> None:
    """Each CP rank's gradient is its own rows' part; Megatron's DDP sums them over CP and its
    schedule undoes the data-parallel average's division by CP: the norm of the same on-policy
    step at DP 2."""
    assert cp_results["cp2_grad_norm"] == pytest.approx(cp_results["cp1_grad_norm"], rel=1e-5)
    assert cp_results["cp2_loss"] == pytest.approx(cp_results["cp1_loss"], abs=1e-3)


def test_a_cp2_checkpoint_resumes_at_cp1(cp_results: dict) -> None:
    assert cp_results["resumed_cp1_loss"] == pytest.approx(cp_results["cp2_loss"], abs=1e-6)


def test_critic_values_and_gradient_at_cp2_equal_cp1(cp_results: dict) -> None:
    a, b = cp_results["cp1_values"], cp_results["cp2_values"]
    assert max(abs(x) for x in a) > 1e-3
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5
    assert cp_results["cp2_critic_grad_norm"] == pytest.approx(cp_results["cp1_critic_grad_norm"], rel=1e-5)
