"""Answer extraction for math-style tasks: ``\\boxed{...}``, GSM8K's ``#### N``, final number."""

from __future__ import annotations

import re
from fractions import Fraction

_NUM = r"-?\$?\d[\d,]*(?:\.\d+)?|-?\$?\.\d+"
_HASH = re.compile(r"####\s*(" + _NUM + r")")
_NUMBER = re.compile(_NUM)


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``, braces balanced (``\\boxed{\\frac{1}{2}}`` works)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j].strip()
    return None  # unbalanced


def extract_answer(text: str, mode: str = "strict") -> str | None:
    """``strict``: only ``\\boxed{}`` or ``#### N``; ``flexible``: else the last number in the text."""
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    m = _HASH.findall(text)
    if m:
        return m[-1]
    if mode == "flexible":
        nums = _NUMBER.findall(text)
        return nums[-1] if nums else None
    if mode != "strict":
        raise ValueError(f"extract_answer mode must be strict|flexible, got {mode!r}")
    return None


def normalize_number(s: str | None) -> Fraction | None:
    """'1,234' '$5' '5.0' '3/4' '\\frac{3}{4}' -> exact Fraction; None when not a number."""
    if s is None:
        return None
    t = s.strip().replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    m = re.fullmatch(r"\\d?frac\{(-?\d+)\}\{(-?\d+)\}", t)
    if m:
        t = f"{m.group(1)}/{m.group(2)}"
    try:
        return Fraction(t)
    except (ValueError, ZeroDivisionError):
        return None
