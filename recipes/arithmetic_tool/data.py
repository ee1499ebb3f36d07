"""Procedurally generated multi-step arithmetic word problems, solved with the calculator.

``difficulty`` = number of operations after the starting amount (1-6); numbers grow with it.
Every problem has an exact integer answer and a reference expression, so demonstrations (for the
warm start) and rewards are exact.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from agent_r1.agent.demonstrations import noisy_demonstrations
from agent_r1.agent.tool_calls import format_tool_call, format_tool_responses
from agent_r1.data.rows import DataRow

AGENT = "arithmetic_tool"
SYSTEM = (
    "Solve the problem. Use the calculator tool for the arithmetic, then give the final answer as \\boxed{N}."
)
NAMES = [
    "Ava",
    "Ben",
    "Cara",
    "Dev",
    "Eli",
    "Fay",
    "Gus",
    "Hana",
    "Ivan",
    "Jo",
    "Kai",
    "Lena",
    "Mo",
    "Nia",
    "Omar",
    "Pia",
]
ITEMS = ["apples", "books", "coins", "stamps", "marbles", "pencils", "cards", "shells", "beads", "stickers"]

TOOLS = ["calculator"]  # the tools its prompt shows


@dataclass(frozen=True)
class Problem:
    question: str
    expression: str
    answer: int


def _op(rng: random.Random, value: int, item: str, scale: int) -> tuple[str, str, int]:
    """One operation: (sentence, expression template with {x} for the running expression, new value)."""
    kind = rng.choice(["add", "sub", "boxes", "mul", "div"])
    if kind == "sub" and value > 1:
        k = rng.randint(1, value - 1)
        return f"gives away {k} {item}", f"{{x}} - {k}", value - k
    if kind == "boxes":
        n, m = rng.randint(2, 9), rng.randint(2, 3 * scale)
        return f"buys {n} boxes with {m} {item} in each box", f"{{x}} + {n} * {m}", value + n * m
    if kind == "mul" and value < 50 * scale:
        f = rng.choice([2, 3])
        word = {2: "doubles", 3: "triples"}[f]
        return f"{word} the number of {item}", f"({{x}}) * {f}", value * f
    if kind == "div":
        divisors = [d for d in (2, 3, 4, 5) if value % d == 0 and value > d]
        if divisors:
            d = rng.choice(divisors)
            return f"splits the {item} into {d} equal piles and keeps one pile", f"({{x}}) / {d}", value // d
    k = rng.randint(2, 10 * scale)
    return f"finds {k} more {item}", f"{{x}} + {k}", value + k


def make_problem(rng: random.Random, difficulty: int = 2) -> Problem:
    if not 1 <= difficulty <= 6:
        raise ValueError(f"difficulty must be in 1..6, got {difficulty}")
    scale = difficulty
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    start = value = rng.randint(3, 20 * scale)
    expr, sentences = str(value), []
    for _ in range(difficulty):
        sentence, template, value = _op(rng, value, item, scale)
        if expr.isdigit():  # no parentheses around a plain number
            template = template.replace("({x})", "{x}")
        expr = template.format(x=expr)
        sentences.append(sentence)
    steps = ". Then ".join(f"{name} {s}" for s in sentences)
    q = f"{name} has {start} {item}. Then {steps}. How many {item} does {name} have now?"
    return Problem(q, expr, value)


def demonstration(p: Problem) -> list[dict[str, str]]:
    """A correct trajectory as chat messages: one calculator call, then the boxed answer."""
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": p.question},
        {"role": "assistant", "content": format_tool_call("calculator", {"expression": p.expression})},
        {"role": "user", "content": format_tool_responses([str(p.answer)])},
        {"role": "assistant", "content": f"The answer is \\boxed{{{p.answer}}}."},
    ]


def demonstrations(rows: list[DataRow], seed: int = 0, tool_rate: float = 1.0) -> list[list[str]]:
    """Assistant turns of a demonstrator for each row (warm start): the calculator, then the
    answer. With ``tool_rate`` < 1 it is a noisy demonstrator: the rest of the time it skips the
    calculator and guesses the starting amount, which is wrong."""

    def with_tool(row: DataRow) -> list[str]:
        expr, answer = row.extra_info["expression"], row.reward_model["ground_truth"]
        return [format_tool_call("calculator", {"expression": expr}), f"The answer is \\boxed{{{answer}}}."]

    def without_tool(row: DataRow) -> list[str]:
        return [f"The answer is \\boxed{{{row.extra_info['expression'].split(' ')[0].strip('()')}}}."]

    return noisy_demonstrations(rows, seed, tool_rate, with_tool, without_tool)


def build_rows(split: str = "train", num: int = 64, seed: int = 0, difficulty: int = 2) -> list[DataRow]:
    """Rows for ``split``; train and test draw from disjoint seed streams."""
    offset = {"train": 0, "test": 1_000_003, "val": 2_000_003}[split]
    rng = random.Random(seed * 7_919 + offset)
    rows = []
    for _ in range(num):
        p = make_problem(rng, difficulty)
        rows.append(
            DataRow(
                prompt=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": p.question}],
                agent_name=AGENT,
                reward_model={"style": "math_number", "ground_truth": str(p.answer)},
                data_source="arithmetic_tool",
                env_kwargs={},
                extra_info={"expression": p.expression, "difficulty": difficulty, "split": split},
            )
        )
    return rows


def corpus(num: int = 2000, seed: int = 0) -> list[str]:
    """Texts a tokenizer for this task is trained on: questions and demonstration turns."""
    rng = random.Random(seed)
    texts = []
    for i in range(num):
        p = make_problem(rng, 1 + i % 6)
        texts += [m["content"] for m in demonstration(p)]
    return texts
