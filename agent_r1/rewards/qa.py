"""Question-answering rewards: exact match after the official HotpotQA / SQuAD answer
normalisation (lower case, punctuation and the articles a/an/the removed, whitespace collapsed),
against any of the answer's aliases; token F1 (HotpotQA's: a yes/no/noanswer mismatch scores 0)
is reported as a task metric.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Any

from agent_r1.rewards.rule import REWARDS, RewardResult

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(s: str) -> str:
    s = "".join(ch for ch in s.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", s).split())


def exact_match(prediction: str, truth: str) -> bool:
    return normalize_answer(prediction) == normalize_answer(truth)


def f1_score(prediction: str, truth: str) -> float:
    p, t = normalize_answer(prediction), normalize_answer(truth)
    if (p in ("yes", "no", "noanswer") or t in ("yes", "no", "noanswer")) and p != t:
        return 0.0
    common = Counter(p.split()) & Counter(t.split())
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p.split()), same / len(t.split())
    return 2 * precision * recall / (precision + recall)


def extract_tagged_answer(text: str) -> str | None:
    """The last ``<answer>...</answer>`` of a response."""
    found = _ANSWER.findall(text)
    return found[-1].strip() if found else None


def aliases(ground_truth: Any) -> list[str]:
    if isinstance(ground_truth, str):
        return [ground_truth]
    if (
        isinstance(ground_truth, list | tuple)
        and ground_truth
        and all(isinstance(a, str) for a in ground_truth)
    ):
        return list(ground_truth)
    raise ValueError(f"ground_truth must be a string or a non-empty list of strings, got {ground_truth!r}")


@REWARDS.register("qa_em")
def qa_em(response: str, ground_truth: Any, format_score: float = 0.0) -> RewardResult:
    """1.0 for an exact match with any alias, ``format_score`` for a wrong tagged answer, else 0."""
    truths = aliases(ground_truth)
    pred = extract_tagged_answer(response)
    if pred is None:
        return RewardResult(0.0, False, False, None, {"metrics": {"em": 0.0, "f1": 0.0}})
    em = any(exact_match(pred, t) for t in truths)
    f1 = max(f1_score(pred, t) for t in truths)
    score = 1.0 if em else format_score
    return RewardResult(score, em, True, pred, {"metrics": {"em": float(em), "f1": f1}})
