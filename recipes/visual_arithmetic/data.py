"""Arithmetic over a number shown in a picture: the agent reads the image, then uses the calculator.

Each problem's starting amount (10-99) is drawn only in the image, as seven-segment digits
(seeded jitter of position, stroke width and colours); the text says what happens to it. The
image travels in the prompt as an OpenAI / Qwen-VL content part (a PNG data URL) after the
question, so the rows are plain chat messages. Demonstrations (the warm start) first say what they
read ("The picture shows 78."), then call the calculator with it; the noisy demonstrator skips the
tool part of the time and answers the number it read, which is wrong. RL has to find out that
using the tool pays; the policy must read the image either way.
"""

from __future__ import annotations

import base64
import io
import random
from dataclasses import dataclass

from agent_r1.agent.demonstrations import noisy_demonstrations
from agent_r1.agent.tool_calls import format_tool_call, format_tool_responses
from agent_r1.data.rows import DataRow

AGENT = "visual_arithmetic"
SYSTEM = (
    "The picture shows a number. Solve the problem: use the calculator tool for the arithmetic, "
    "then give the final answer as \\boxed{N}."
)
NAMES = ["Ava", "Ben", "Cara", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivan", "Jo", "Kai", "Lena"]
ITEMS = ["apples", "books", "coins", "stamps", "marbles", "pencils", "cards", "shells"]
CELL_W, CELL_H = 28, 56  # one digit; the Qwen2-VL tower merges 28 x 28 pixels into one token

# seven segments: a top, b upper right, c lower right, d bottom, e lower left, f upper left, g middle
DIGIT_SEGMENTS = {
    0: "abcdef", 1: "bc", 2: "abged", 3: "abgcd", 4: "fgbc",
    5: "afgcd", 6: "afgedc", 7: "abc", 8: "abcdefg", 9: "abcdfg",
}  # fmt: skip

TOOLS = ["calculator"]  # the tools its prompt shows


def render_number(n: int, rng: random.Random) -> bytes:
    """``n`` (10-99) as two seven-segment digits on a 56 x 56 PNG, jittered by ``rng``."""
    from PIL import Image, ImageDraw

    if not 10 <= n <= 99:
        raise ValueError(f"the picture holds a two-digit number, got {n}")
    bg = (rng.randint(225, 255),) * 3
    ink = (rng.randint(0, 50),) * 3
    im = Image.new("RGB", (2 * CELL_W, CELL_H), bg)
    draw = ImageDraw.Draw(im)
    for i, digit in enumerate((n // 10, n % 10)):
        t = rng.randint(3, 4)
        x0, y0 = i * CELL_W + 4 + rng.randint(-1, 1), 4 + rng.randint(-1, 1)
        x1, y1 = x0 + 19, y0 + 46
        ym = (y0 + y1) // 2
        boxes = {
            "a": (x0, y0, x1, y0 + t), "b": (x1 - t, y0, x1, ym), "c": (x1 - t, ym, x1, y1),
            "d": (x0, y1 - t, x1, y1), "e": (x0, ym, x0 + t, y1), "f": (x0, y0, x0 + t, ym),
            "g": (x0, ym - t // 2, x1, ym + (t + 1) // 2),
        }  # fmt: skip
        for s in DIGIT_SEGMENTS[digit]:
            draw.rectangle(boxes[s], fill=ink)
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


@dataclass(frozen=True)
class Problem:
    number: int  # what the picture shows
    question: str  # the text (it never states the number)
    expression: str
    answer: int


def make_problem(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    n = rng.randint(10, 99)
    kind = rng.choice(["add", "sub", "boxes"])
    if kind == "add":
        k = rng.randint(2, 20)
        op, expr, ans = f"finds {k} more {item}", f"{n} + {k}", n + k
    elif kind == "sub":
        k = rng.randint(1, n - 1)
        op, expr, ans = f"gives away {k} {item}", f"{n} - {k}", n - k
    else:
        b, m = rng.randint(2, 9), rng.randint(2, 6)
        op, expr, ans = f"buys {b} boxes with {m} {item} in each box", f"{n} + {b} * {m}", n + b * m
    q = f"The picture shows how many {item} {name} has. Then {name} {op}. How many {item} does {name} have now?"
    return Problem(n, q, expr, ans)


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def build_rows(split: str = "train", num: int = 64, seed: int = 0) -> list[DataRow]:
    """Rows for ``split``; train, test and val draw from disjoint seed streams."""
    offsets = {"train": 0, "test": 1_000_003, "val": 2_000_003}
    if split not in offsets:
        raise ValueError(f"split must be one of {sorted(offsets)}, got {split!r}")
    rng = random.Random(seed * 7_919 + offsets[split])
    rows = []
    for _ in range(num):
        p = make_problem(rng)
        image = data_url(render_number(p.number, rng))
        rows.append(
            DataRow(
                prompt=[
                    {"role": "system", "content": SYSTEM},
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": p.question}, {"type": "image", "image": image}],
                    },
                ],  # fmt: skip
                agent_name=AGENT,
                reward_model={"style": "math_number", "ground_truth": str(p.answer)},
                data_source="visual_arithmetic",
                env_kwargs={},
                extra_info={"expression": p.expression, "number": p.number, "split": split},
            )
        )
    return rows


def demonstrations(rows: list[DataRow], seed: int = 0, tool_rate: float = 1.0) -> list[list[str]]:
    """Assistant turns of a demonstrator for each row (warm start): the calculator on the number
    in the picture, then the answer; with ``tool_rate`` < 1 it answers the picture's number
    without the tool the rest of the time (wrong)."""

    def seen(row: DataRow) -> str:
        return f"The picture shows {row.extra_info['number']}."

    def with_tool(row: DataRow) -> list[str]:
        call = format_tool_call("calculator", {"expression": row.extra_info["expression"]})
        return [f"{seen(row)}\n{call}", f"The answer is \\boxed{{{row.reward_model['ground_truth']}}}."]

    def without_tool(row: DataRow) -> list[str]:
        return [f"{seen(row)} The answer is \\boxed{{{row.extra_info['number']}}}."]

    return noisy_demonstrations(rows, seed, tool_rate, with_tool, without_tool)


def corpus(num: int = 2000, seed: int = 0) -> list[str]:
    """Texts a tokenizer for this task is trained on: questions and demonstration turns."""
    rng = random.Random(seed)
    texts = [SYSTEM]
    for _ in range(num):
        p = make_problem(rng)
        texts += [
            p.question,
            f"The picture shows {p.number}.",
            format_tool_call("calculator", {"expression": p.expression}),
            format_tool_responses([str(p.answer)]),
            f"The answer is \\boxed{{{p.answer}}}.",
        ]
    return texts
