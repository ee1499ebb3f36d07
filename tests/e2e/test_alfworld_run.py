"""One short alfworld training run as a user starts it (the StepPO preset with a few overrides):
the launcher builds the model from the games' texts, the warm start replays the planner expert's
plans on the real engine, the agents play through env_step, GiGPO-style anchors and the critic's
values are recorded, and the held-out games are evaluated."""

from __future__ import annotations

import pytest
from train_checks import check_finished, env_step_demonstrations, read_records, reduced, train

from agent_r1.train.plot import read_scalars

pytest.importorskip("alfworld")


def test_alfworld_short_run(tmp_path):
    run = tmp_path / "run"
    # the default 120 / 24 / 24 games (the recipe's tests generate them), not the preset's 480 / 48 / 48
    args = reduced(
        tmp_path / "model",
        run,
        "recipe.options.games=null",
        preset="alfworld_steppo",
        build=True,
        demos=32,
        action_tokens=None,
    )
    s = check_finished(train(args, timeout=600), run, 2)
    assert s["algorithm"] == "steppo"
    infos = env_step_demonstrations(run)
    sft = read_records(run, 0, "sft_records")
    won = [i["reward"] for i in infos if isinstance(i.get("reward"), dict)]
    assert won and all(r["correct"] for r in won)  # every demonstration wins its game
    assert set(sft.column("reward").to_pylist()) <= {0.0, 1.0}
    scalars = read_scalars(run / "tensorboard")
    for tag in ("eval/success", "rollout/success"):
        assert tag in scalars, sorted(scalars)
