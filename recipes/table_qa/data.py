"""Table question answering with code (TableMind-style): questions over CSV tables in the
WikiTableQuestions layout, answered by running pandas code with the ``python`` tool.

The layout, as the dataset ships it: ``data/<split>.tsv`` (``training.tsv``,
``pristine-unseen-tables.tsv``, ...) with the header ``id  utterance  context  targetValue``
(tab-separated; ``context`` is a table's path such as ``csv/204-csv/590.csv``, relative to the
dataset's root; ``targetValue`` a list separated by ``|``; in every field ``\\n``, ``\\\\`` and
``\\p`` stand for a newline, a backslash and ``|``), and the tables as ``csv/2xx-csv/N.csv``.
``recipe.train_path`` / ``test_path`` name a split's TSV; without them the seeded offline world
writes its tables and questions in this same layout and the same loader reads them back.

Each row's table goes into the episode's sandbox as ``table.csv``; the prompt shows its columns
and first rows, so answering needs code.
"""

from __future__ import annotations

import csv
import io
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path

from agent_r1.agent.demonstrations import noisy_demonstrations
from agent_r1.agent.tool_calls import format_tool_call, format_tool_responses
from agent_r1.data.rows import DataRow

AGENT = "table_qa"
TOOLS = ["python"]
TABLE = "table.csv"
SYSTEM = (
    "Answer the question about the table in table.csv. Use the python tool to compute it "
    "(pandas as pd), then give the final answer as \\boxed{answer}."
)
PREVIEW_ROWS = 2

TEAMS = ["Lions", "Tigers", "Bears", "Wolves", "Eagles", "Hawks", "Sharks", "Bulls", "Foxes", "Owls",
         "Rams", "Jets", "Kings", "Stars", "Comets", "Giants"]  # fmt: skip
CITIES = ["Oslo", "Lima", "Rome", "Kyiv", "Cairo", "Quito"]


# ---- the WikiTableQuestions layout -----------------------------------------------------------------
def tsv_unescape(s: str) -> str:
    """WTQ's TSV escapes: ``\\n`` newline, ``\\p`` pipe, ``\\\\`` backslash."""
    out, i = [], 0
    while i < len(s):
        if s[i] == "\\" and i + 1 < len(s):
            out.append({"n": "\n", "p": "|", "\\": "\\"}.get(s[i + 1], s[i : i + 2]))
            i += 2
        else:
            out.append(s[i])
            i += 1
    return "".join(out)


def tsv_escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace("\n", "\\n").replace("|", "\\p")


@dataclass(frozen=True)
class Example:
    id: str
    question: str
    table_path: str  # ``context``: relative to the dataset's root
    table: str  # the CSV text
    answers: list[str]


def read_split(tsv: str | Path) -> list[Example]:
    """A split's TSV and the tables it names (the root is the folder above ``data/``)."""
    tsv = Path(tsv)
    root = tsv.resolve().parent.parent
    out = []
    with open(tsv, encoding="utf-8", newline="") as f:
        header = f.readline().rstrip("\n").split("\t")
        if header != ["id", "utterance", "context", "targetValue"]:
            raise ValueError(
                f"{tsv}: header {header}; WikiTableQuestions' is id, utterance, context, targetValue"
            )
        for n, line in enumerate(f, 2):
            fields = line.rstrip("\n").split("\t")
            if len(fields) != 4:
                raise ValueError(f"{tsv}:{n}: {len(fields)} tab-separated fields, expected 4")
            ex_id, utterance, context, target = fields
            table = root / context
            if not table.is_file():
                raise ValueError(f"{tsv}:{n}: table {context} not found under {root}")
            answers = [tsv_unescape(v) for v in target.split("|")]
            out.append(
                Example(ex_id, tsv_unescape(utterance), context, table.read_text(encoding="utf-8"), answers)
            )
    return out


def write_split(root: Path, name: str, examples: list[Example]) -> Path:
    """``examples`` in the layout: ``root/data/<name>.tsv`` and each table at its ``context``."""
    (root / "data").mkdir(parents=True, exist_ok=True)
    for ex in examples:
        (root / ex.table_path).parent.mkdir(parents=True, exist_ok=True)
        (root / ex.table_path).write_text(ex.table, encoding="utf-8")
    path = root / "data" / f"{name}.tsv"
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write("id\tutterance\tcontext\ttargetValue\n")
        for ex in examples:
            target = "|".join(tsv_escape(a) for a in ex.answers)
            f.write(f"{ex.id}\t{tsv_escape(ex.question)}\t{ex.table_path}\t{target}\n")
    return path


# ---- the seeded offline world ---------------------------------------------------------------------
def make_example(rng: random.Random, i: int, folder: int) -> tuple[Example, str]:
    """A league table and one question over it: (the example, the pandas code that answers it)."""
    teams = rng.sample(TEAMS, rng.randint(6, 9))
    rows = [(t, rng.choice(CITIES), rng.randint(0, 20), rng.randint(0, 60)) for t in teams]
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["Team", "City", "Wins", "Points"])
    w.writerows(rows)
    kind = rng.choice(["sum", "count", "max"])
    if kind == "sum":
        city = rng.choice([r[1] for r in rows])
        q = f"What is the total Points of the teams from {city}?"
        answer = str(sum(r[3] for r in rows if r[1] == city))
        expr = f"df[df.City == '{city}'].Points.sum()"
    elif kind == "count":
        n = rng.randint(3, 15)
        q = f"How many teams have more than {n} Wins?"
        answer = str(sum(1 for r in rows if r[2] > n))
        expr = f"(df.Wins > {n}).sum()"
    else:
        top = max(r[3] for r in rows)
        q = "Which team has the most Points?"
        answer = "|".join(r[0] for r in rows if r[3] == top)  # a tie is a list answer
        expr = "'|'.join(df[df.Points == df.Points.max()].Team)"
    code = f"df = pd.read_csv('{TABLE}')\nprint({expr})"
    return Example(f"nt-{i}", q, f"csv/{200 + folder}-csv/{i}.csv", buf.getvalue(), answer.split("|")), code


def world(split: str, num: int, seed: int) -> list[tuple[Example, str]]:
    offset = {"train": 0, "test": 1_000_003, "val": 2_000_003}[split]
    rng = random.Random(seed * 7_919 + offset)
    return [make_example(rng, i, {"train": 4, "test": 3, "val": 5}[split]) for i in range(num)]


# ---- rows ----------------------------------------------------------------------------------------
def preview(table: str) -> str:
    lines = table.strip().splitlines()
    more = len(lines) - 1 - PREVIEW_ROWS
    return "\n".join(lines[: 1 + PREVIEW_ROWS]) + (f"\n... ({more} more rows)" if more > 0 else "")


def to_row(ex: Example, split: str, code: str | None = None) -> DataRow:
    user = f"{ex.question}\ntable.csv:\n{preview(ex.table)}"
    return DataRow(
        prompt=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
        agent_name=AGENT,
        reward_model={"style": "wtq", "ground_truth": ex.answers},
        data_source="wikitablequestions",
        env_kwargs={"tool_kwargs": {"python": {"files": {TABLE: ex.table}}}},
        extra_info={
            "id": ex.id,
            "context": ex.table_path,
            "split": split,
            **({"code": code} if code else {}),
        },
    )


def build_rows(
    split: str = "train", num: int | None = 64, seed: int = 0, path: str | None = None
) -> list[DataRow]:
    """Rows of ``split``: the WikiTableQuestions TSV at ``path``, else the seeded world written in
    the same layout (to a temporary folder) and read back by the same loader."""
    if path:
        return [to_row(ex, split) for ex in read_split(path)[:num]]
    made = world(split, num or 64, seed)
    with tempfile.TemporaryDirectory() as root:
        examples = read_split(write_split(Path(root), split, [ex for ex, _ in made]))
    return [to_row(ex, split, code) for ex, (_, code) in zip(examples, made, strict=True)]


def answer_text(answers: list[str]) -> str:
    return f"The answer is \\boxed{{{'|'.join(answers)}}}."


def demonstrations(rows: list[DataRow], seed: int = 0, tool_rate: float = 1.0) -> list[list[str]]:
    """The code, then the boxed answer; a noisy demonstrator (``tool_rate`` < 1) otherwise answers
    from the preview: the first row's team, or its Points (usually wrong)."""

    def with_tool(row: DataRow) -> list[str]:
        return [
            format_tool_call("python", {"code": row.extra_info["code"]}),
            answer_text(row.reward_model["ground_truth"]),
        ]

    def without_tool(row: DataRow) -> list[str]:
        first = next(
            csv.reader(io.StringIO(row.env_kwargs["tool_kwargs"]["python"]["files"][TABLE].splitlines()[1]))
        )
        guess = first[0] if "Which" in row.prompt[-1]["content"] else first[3]
        return [answer_text([guess])]

    return noisy_demonstrations(rows, seed, tool_rate, with_tool, without_tool)


def corpus(num: int = 1500, seed: int = 0) -> list[str]:
    """Texts the task's tiny tokenizer is trained on: prompts, code, results and answers."""
    texts = [SYSTEM]
    for row in build_rows("train", num, seed):
        code = row.extra_info["code"]
        answers = row.reward_model["ground_truth"]
        texts += [row.prompt[-1]["content"], format_tool_call("python", {"code": code}),
                  format_tool_responses(["|".join(answers)]), answer_text(answers)]  # fmt: skip
    return texts
