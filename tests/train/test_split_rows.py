"""A run's rows, split by split: the public GSM8K files as they ship, parquet data rows, the
offline sample's disjoint splits, clear errors for too few rows, and train/test never sharing a
file unless asked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent_r1.data.rows import RowError, write_rows
from agent_r1.train.config import load_config
from agent_r1.train.splits import shared_file_problems, split_rows
from recipes import RECIPES

ROOT = Path(__file__).resolve().parents[2]


def _gsm8k_file(path: Path, n: int, start: int = 0) -> Path:
    lines = [
        json.dumps({"question": f"Tom has {i} apples and buys {i + 1} more. How many?", "answer": f"{i}+{i + 1}={2 * i + 1}\n#### {2 * i + 1}"})
        for i in range(start, start + n)
    ]  # fmt: skip
    path.write_text("\n".join(lines) + "\n")
    return path


def test_recipes_register_themselves_by_folder():
    folders = sorted(p.parent.name for p in (ROOT / "recipes").glob("*/data.py"))
    assert list(RECIPES) == folders and {"arithmetic_tool", "gsm8k", "gsm8k_tool"} <= set(RECIPES)


def test_gsm8k_sample_splits_are_disjoint():
    cfg = load_config(["recipe=gsm8k_tool"])
    train, test = split_rows(cfg, "train"), split_rows(cfg, "test")
    assert (len(train), len(test)) == (16, 6)
    q = lambda rows: {r.prompt[-1]["content"] for r in rows}  # noqa: E731
    assert not q(train) & q(test)


def test_gsm8k_public_files_split_by_split(tmp_path):
    tr = _gsm8k_file(tmp_path / "train.jsonl", 5)
    te = _gsm8k_file(tmp_path / "test.jsonl", 3, start=100)
    cfg = load_config(
        [
            "recipe=gsm8k",
            f"recipe.train_path={tr}",
            f"recipe.test_path={te}",
            "recipe.train_size=5",
            "recipe.test_size=3",
        ]
    )
    train, test = split_rows(cfg, "train"), split_rows(cfg, "test")
    assert [r.reward_model["ground_truth"] for r in train] == ["1", "3", "5", "7", "9"]
    assert [r.reward_model["ground_truth"] for r in test] == ["201", "203", "205"]
    assert all(r.extra_info["split"] == "test" for r in test)


def test_asking_for_more_rows_than_exist_names_the_file_and_both_counts(tmp_path):
    tr = _gsm8k_file(tmp_path / "train.jsonl", 5)
    cfg = load_config(["recipe=gsm8k", f"recipe.train_path={tr}", "recipe.train_size=7473"])
    with pytest.raises(RowError, match=rf"{tr}: 5 train problems, but 7473 were asked for"):
        split_rows(cfg, "train")
    with pytest.raises(RowError, match=r"6 test problems, but 64 were asked for"):
        split_rows(load_config(["recipe=gsm8k", "recipe.test_size=64"]), "test")


def test_parquet_data_rows(tmp_path):
    from recipes import load_recipe

    rows = load_recipe("arithmetic_tool").build_rows(split="train", num=6, seed=3)
    write_rows(rows[:4], tmp_path / "a.parquet")
    write_rows(rows[4:], tmp_path / "b.parquet")
    files = f"data.train_files=[{tmp_path / 'a.parquet'},{tmp_path / 'b.parquet'}]"
    got = split_rows(load_config([files, "recipe.train_size=6"]), "train")
    assert [r.prompt for r in got] == [r.prompt for r in rows]
    with pytest.raises(RowError, match=r"6 train rows, but recipe.train_size asks for 7"):
        split_rows(load_config([files, "recipe.train_size=7"]), "train")


def test_train_and_test_never_share_a_file_unless_asked(tmp_path):
    f = tmp_path / "rows.parquet"
    same = [f"data.train_files=[{f}]", f"data.test_files=[{f}]"]
    assert "train and test read the same file" in shared_file_problems(load_config(same))[0]
    assert shared_file_problems(load_config([*same, "data.shared_file_ok=true"])) == []
    assert shared_file_problems(load_config([f"data.train_files=[{f}]"])) == []
