"""``--run --base``: the model the run started from, with the run's settings (its held-out rows,
episode budgets, engine), to compare a checkpoint with."""

from __future__ import annotations

import argparse

import pytest

from agent_r1.commands.policy_source import resolve_model
from agent_r1.errors import UsageError
from agent_r1.train.config import load_config, to_yaml


def _args(run, iteration=None, base=False):
    return argparse.Namespace(
        model=None, url=None, run=str(run), iteration=iteration, base=base, strict=False
    )


def test_base_is_the_starting_model_with_the_runs_settings(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(to_yaml(load_config(["model.path=/models/base", "recipe.test_size=7"])))
    cfg, model, source = resolve_model(_args(run, base=True), tmp_path / "exports")
    assert model == source == "/models/base" and cfg.recipe.test_size == 7
    with pytest.raises(UsageError, match="--base and --iteration: choose one"):
        resolve_model(_args(run, iteration=3, base=True), tmp_path / "exports")
    with pytest.raises(UsageError, match="--base needs --run"):
        resolve_model(argparse.Namespace(model="/m", url=None, run=None, iteration=None, base=True), tmp_path)
    with pytest.raises(Exception, match="no complete checkpoint"):  # without --base: a checkpoint
        resolve_model(_args(run), tmp_path / "exports")
