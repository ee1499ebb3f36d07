from fractions import Fraction

import pytest

from agent_r1.rewards import compute_reward, extract_answer, extract_boxed, normalize_number


@pytest.mark.parametrize(
    "text,boxed",
    [
        ("x \\boxed{42} y", "42"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{1} then \\boxed{2}", "2"),
        ("\\boxed{oops", None),
        ("none", None),
    ],
)
def test_boxed(text, boxed):
    assert extract_boxed(text) == boxed


@pytest.mark.parametrize(
    "text,strict,flexible",
    [
        ("so 3*4 = 12\n#### 12", "12", "12"),
        ("#### 1,234", "1,234", "1,234"),
        ("the total is 17 apples", None, "17"),
        ("\\boxed{5} and #### 6", "5", "5"),
        ("-4.5 is it", None, "-4.5"),
        ("nothing", None, None),
    ],
)
def test_extract(text, strict, flexible):
    assert extract_answer(text) == strict and extract_answer(text, "flexible") == flexible


@pytest.mark.parametrize(
    "s,v",
    [
        ("1,234", 1234),
        ("$5", 5),
        ("5.0", 5),
        ("3/4", Fraction(3, 4)),
        ("\\frac{3}{4}", Fraction(3, 4)),
        ("-2", -2),
        ("abc", None),
        ("1/0", None),
    ],
)
def test_normalize(s, v):
    assert normalize_number(s) == v


def test_rule_reward_components():
    rm = {"style": "math_number", "ground_truth": "1234"}
    assert compute_reward(rm, "\\boxed{1,234}").score == 1.0
    r = compute_reward(rm, "#### 99")
    assert (r.score, r.correct, r.formatted, r.prediction) == (0.1, False, True, "99")
    assert compute_reward(rm, "1234 I think").score == 0.0  # strict: no format, no credit
    assert compute_reward({**rm, "mode": "flexible"}, "1234 I think").score == 1.0
    assert compute_reward({**rm, "format_score": 0.0}, "#### 99").score == 0.0
    with pytest.raises(KeyError, match="unknown reward style 'nope'"):
        compute_reward({"style": "nope", "ground_truth": "1"}, "x")
    with pytest.raises(ValueError, match="not a number"):
        compute_reward({"style": "gsm8k", "ground_truth": "abc"}, "x")
