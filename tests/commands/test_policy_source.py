"""Where ``--run --iteration`` points: a checkpoint, or for iteration 0 of a run without a warm start
the model the run started from (with the run's settings)."""

from __future__ import annotations

import argparse

import pytest

from agent_r1.commands.policy_source import resolve_model
from agent_r1.train.config import load_config, to_yaml


def _run(tmp_path, *overrides):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(to_yaml(load_config(list(overrides))))
    return run


def _args(run, iteration):
    return argparse.Namespace(model=None, url=None, run=str(run), iteration=iteration, strict=False)


def test_iteration_0_without_a_warm_start_is_the_starting_model(tmp_path):
    run = _run(tmp_path, "model.path=/models/base")
    cfg, model, source = resolve_model(_args(run, 0), tmp_path / "exports")
    assert model == source == "/models/base" and cfg.model.path == "/models/base"
    with pytest.raises(Exception, match="no complete checkpoint"):  # any other iteration needs one
        resolve_model(_args(run, 3), tmp_path / "exports")
