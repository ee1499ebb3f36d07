"""WikiTableQuestions' answer check: the answer (``\\boxed{...}``) is a list of values separated by
``|``; it is right when it matches the target list as a multiset, a value matching a target when
both read as numbers and are equal, or when their normalised texts are equal (WTQ's evaluator
compares numbers by value and strings after normalisation in the same way)."""

from __future__ import annotations

from typing import Any

from agent_r1.rewards.answer import extract_boxed, normalize_number
from agent_r1.rewards.qa import aliases, normalize_answer
from agent_r1.rewards.rule import REWARDS, RewardResult


def _same(a: str, b: str) -> bool:
    na, nb = normalize_number(a), normalize_number(b)
    if na is not None and nb is not None:
        return na == nb
    return normalize_answer(a) == normalize_answer(b)


def values_match(predicted: list[str], targets: list[str]) -> bool:
    left = list(targets)
    for p in predicted:
        hit = next((i for i, t in enumerate(left) if _same(p, t)), None)
        if hit is None:
            return False
        left.pop(hit)
    return not left


@REWARDS.register("wtq")
def wtq(response: str, ground_truth: Any, format_score: float = 0.0) -> RewardResult:
    targets = aliases(ground_truth)  # the targetValue list
    pred = extract_boxed(response)
    if pred is None:
        return RewardResult(0.0, False, False, None)
    correct = values_match([v.strip() for v in pred.split("|")], targets)
    return RewardResult(1.0 if correct else format_score, correct, True, pred)
