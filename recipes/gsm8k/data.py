"""GSM8K rows. Reads the public layout (``{"question", "answer": "... #### N"}`` as jsonl or
parquet: the dataset's ``train`` and ``test`` files, given as ``recipe.train_path`` /
``recipe.test_path``); without them, 22 hand-written GSM8K-style problems (``problems.jsonl``) for
tests and demos, split into 16 train and 6 test problems (no GSM8K copy is available offline).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from agent_r1.data.rows import DataRow, RowError
from agent_r1.rewards.answer import normalize_number

AGENT = "gsm8k"
INSTRUCTION = "Let's think step by step and put the final answer in \\boxed{}."
SAMPLE = Path(__file__).with_name("problems.jsonl")

TOOLS = []  # the tools its prompt shows


def read_gsm8k(path: str | Path) -> list[dict[str, Any]]:
    """Problems from a GSM8K jsonl or parquet file, with ``ground_truth`` parsed from ``#### N``."""
    path = Path(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        raw = pq.read_table(path).to_pylist()
    else:
        raw = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    out = []
    for i, r in enumerate(raw):
        if not isinstance(r.get("question"), str) or not isinstance(r.get("answer"), str):
            raise RowError(f"{path} row {i}: needs string keys 'question' and 'answer'")
        if "####" not in r["answer"]:
            raise RowError(f"{path} row {i}: key 'answer' has no '#### N' final answer")
        truth = r["answer"].rsplit("####", 1)[1].strip().replace(",", "")
        if normalize_number(truth) is None:
            raise RowError(f"{path} row {i}: key 'answer': final answer {truth!r} is not a number")
        out.append({"question": r["question"], "solution": r["answer"], "ground_truth": truth})
    return out


def to_row(
    p: dict[str, Any], agent: str, system: str | None, split: str, env_kwargs: dict[str, Any] | None = None
) -> DataRow:
    prompt = [{"role": "system", "content": system}] if system else []
    prompt.append({"role": "user", "content": f"{p['question']}\n{INSTRUCTION}"})
    return DataRow(
        prompt=prompt,
        agent_name=agent,
        reward_model={"style": "math_number", "ground_truth": p["ground_truth"]},
        data_source="gsm8k",
        env_kwargs=env_kwargs or {},
        extra_info={"split": split},
    )


SAMPLE_TRAIN = 16  # the sample's first 16 problems train, the other 6 are held out


def problems_for(split: str, num: int | None, path: str | None) -> list[dict[str, Any]]:
    """``num`` problems of ``split`` from ``path`` (the split's own file) or from the sample (its
    split's disjoint part); asking for more than there are is an error naming the file and both
    counts."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be train or test, got {split!r}")
    if path:
        problems, source = read_gsm8k(path), str(path)
    else:
        sample = read_gsm8k(SAMPLE)
        problems = sample[:SAMPLE_TRAIN] if split == "train" else sample[SAMPLE_TRAIN:]
        source = f"{SAMPLE} ({split} part; pass recipe.{split}_path for the real dataset)"
    if num is not None and num > len(problems):
        raise RowError(
            f"{source}: {len(problems)} {split} problems, but {num} were asked for (recipe.{split}_size)"
        )
    return problems[:num]


def build_rows(
    split: str = "train", num: int | None = None, seed: int = 0, path: str | None = None
) -> list[DataRow]:
    return [to_row(p, AGENT, None, split) for p in problems_for(split, num, path)]


def corpus(num: int = 0, seed: int = 0) -> list[str]:
    return [p["question"] + "\n" + p["solution"] for p in read_gsm8k(SAMPLE)]
