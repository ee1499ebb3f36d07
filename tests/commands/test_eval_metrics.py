"""``agent-r1 eval``'s metrics against hand-worked values: unbiased pass@k against every k-subset,
the Wilson interval by hand, the bootstrap intervals by hand and against the normal
approximation."""

from __future__ import annotations

import itertools
import math

import pytest

from agent_r1.commands.evaluate import bootstrap_ci, paired_gain, pass_at_k, wilson
from agent_r1.errors import UsageError


@pytest.mark.parametrize("n,c", [(1, 0), (1, 1), (4, 1), (5, 2), (8, 3), (6, 6)])
def test_pass_at_k_is_the_chance_a_random_k_subset_holds_a_success(n, c):
    outcomes = [1] * c + [0] * (n - c)
    for k in range(1, n + 1):
        subsets = list(itertools.combinations(range(n), k))
        brute = sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)
        assert pass_at_k(n, c, k) == pytest.approx(brute)
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)


def test_wilson_interval_by_hand():
    lo, hi = wilson(0, 10)  # 0 of 10: [0, z^2 / (n + z^2)]
    assert lo == 0.0 and hi == pytest.approx(1.96**2 / (10 + 1.96**2))
    lo, hi = wilson(5, 10)
    assert (lo + hi) / 2 == pytest.approx(0.5) and hi - lo == pytest.approx(
        2 * 1.96 * math.sqrt(0.025 + 1.96**2 / 400) / (1 + 1.96**2 / 10)
    )


def test_bootstrap_interval_by_hand_and_against_the_normal_approximation():
    # two values: a resample's mean is 0, 1/2 or 1 with chances 1/4, 1/2, 1/4 -> the 2.5% and 97.5%
    # quantiles are 0 and 1
    assert bootstrap_ci([0.0, 1.0]) == (0.0, 1.0)
    assert bootstrap_ci([1.0] * 7) == (1.0, 1.0)  # no spread, no interval
    xs = [1.0] * 200 + [0.0] * 300  # p = 0.4 over 500 prompts: p +- 1.96 sqrt(p (1 - p) / n)
    lo, hi = bootstrap_ci(xs)
    half = 1.96 * math.sqrt(0.4 * 0.6 / 500)
    assert lo == pytest.approx(0.4 - half, abs=0.006) and hi == pytest.approx(0.4 + half, abs=0.006)
    assert bootstrap_ci(xs) == (lo, hi)  # seeded: the same values, the same interval


def _metrics(per_prompt, data="reasoning_gym:test"):
    return {
        "per_prompt_success": per_prompt,
        "success": sum(per_prompt) / len(per_prompt),
        "data": data,
        "settings": {"num": len(per_prompt)},
        "model": "m",
    }


def test_the_gain_interval_is_paired_over_prompts():
    before = [float(i % 2) for i in range(400)]  # 0.5
    after = [1.0 if i % 2 or i % 10 == 0 else 0.0 for i in range(400)]  # the same, plus 1 in 10
    g = paired_gain(_metrics(after), _metrics(before), "b")
    assert g["gain"] == pytest.approx(0.1)
    lo, hi = g["gain_ci95"]
    # paired: the differences are 0 or 1 (p = 0.1); unpaired the interval would be ~2.3x wider
    half = 1.96 * math.sqrt(0.1 * 0.9 / 400)
    assert lo == pytest.approx(0.1 - half, abs=0.01) and hi == pytest.approx(0.1 + half, abs=0.01)
    assert lo > 0
    with pytest.raises(UsageError, match="evaluated other rows"):
        paired_gain(_metrics(after), _metrics(before[:399]), "b")
    with pytest.raises(UsageError, match="evaluated other rows"):
        paired_gain(_metrics(after), _metrics(before, data="other.parquet"), "b")
    with pytest.raises(UsageError, match="no per_prompt_success"):
        paired_gain(_metrics(after), {"success": 0.5}, "b")
