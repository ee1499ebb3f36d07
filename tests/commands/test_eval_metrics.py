"""``agent-r1 eval``'s metrics against hand-worked values: unbiased pass@k against every k-subset,
the Wilson interval by hand."""

from __future__ import annotations

import itertools
import math

import pytest

from agent_r1.commands.evaluate import pass_at_k, wilson


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
