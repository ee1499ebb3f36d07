"""The rows of a run's train and test splits, from one place: parquet data rows
(``data.train_files`` / ``data.test_files``) when given, else the recipe's ``build_rows`` (with
``recipe.train_path`` / ``recipe.test_path`` for recipes that read a public dataset). A split with
fewer rows than ``recipe.<split>_size`` is an error naming where the rows came from and both
counts; train and test never read the same file unless ``data.shared_file_ok``."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from agent_r1.data.rows import DataRow, RowError, load_rows
from agent_r1.train.config import TrainConfig

log = logging.getLogger("agent_r1.rows")


def split_size(cfg: TrainConfig, split: str) -> int:
    return cfg.recipe.train_size if split == "train" else cfg.recipe.test_size


def split_rows(cfg: TrainConfig, split: str, num: int | None = None) -> list[DataRow]:
    """``num`` (default ``recipe.<split>_size``) rows of ``split`` ('train' | 'test')."""
    from agent_r1.agent.flow import AGENTS
    from recipes import load_all, load_recipe

    load_all()
    r = cfg.recipe
    want = split_size(cfg, split) if num is None else num
    files = cfg.data.train_files if split == "train" else cfg.data.test_files
    if files:
        rows = [row for f in files for row in load_rows(f, AGENTS)]
        source = ", ".join(files)
    else:
        path = r.train_path if split == "train" else r.test_path
        kwargs: dict[str, Any] = dict(r.options)
        if path:
            kwargs["path"] = path
        rows = load_recipe(r.name).build_rows(split=split, num=want, seed=r.seed, **kwargs)
        source = path or f"recipe {r.name}"
    if len(rows) < want:
        raise RowError(f"{source}: {len(rows)} {split} rows, but recipe.{split}_size asks for {want}")
    rows = rows[:want]
    env = {**({"server": "run"} if cfg.rollout.env_server else {}), **r.env}
    if env:  # config-wide environment options (e.g. the context mode) under each row's own
        rows = [dataclasses.replace(row, env_kwargs={**env, **row.env_kwargs}) for row in rows]
    return rows


def shared_file_problems(cfg: TrainConfig) -> list[str]:
    """Train and test reading the same file: an error unless ``data.shared_file_ok`` (a warning)."""
    train = {Path(p).resolve() for p in [*cfg.data.train_files, cfg.recipe.train_path] if p}
    test = {Path(p).resolve() for p in [*cfg.data.test_files, cfg.recipe.test_path] if p}
    shared = sorted(str(p) for p in train & test)
    if not shared:
        return []
    if cfg.data.shared_file_ok:
        log.warning("train and test read the same file(s) %s (data.shared_file_ok=true)", shared)
        return []
    return [
        f"data: train and test read the same file(s) {shared}: held-out numbers would be training "
        "numbers (give each split its own file, or set data.shared_file_ok=true)"
    ]
