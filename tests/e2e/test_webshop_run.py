"""One short webshop training run as a user starts it (the preset with a few overrides): the
launcher builds the model and starts the site as the run's env_server role, the warm start replays
the shoppers' demonstrations there, the agents shop through env_step, the purchase score and
GiGPO's anchors are recorded; the site is killed under the first rollout and the launcher restarts it
while the run goes on (that environments then find it at its new address: tests/train/test_env_server.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess

from train_checks import check_finished, env_step_demonstrations, reduced, run_until

from agent_r1.train.plot import read_scalars


def test_webshop_short_run(tmp_path):
    run = tmp_path / "run"
    args = reduced(tmp_path / "model", run, "algorithm=gigpo", "algorithm.critic=false", "rollout.env_server=true",
                   preset="webshop_steppo", build=True, demos=64, action_tokens=None)  # fmt: skip
    rc, out = run_until(
        args,
        run,
        (run / "control" / "tasks" / "train_000000.w0.progress").exists,
        "the first rollout",
        lambda _: os.kill(
            json.loads((run / "control" / "roles" / "env_server_0.json").read_text())["pid"], signal.SIGKILL
        ),
        ready_timeout=400,
        timeout=400,
    )
    s = check_finished(subprocess.CompletedProcess(args, rc, out, ""), run, 2)
    assert "env_server_0 exited with -9; restarting it" in out
    assert (run / "logs" / "env_server_0.log").read_text().count("webshop environment") == 2
    assert s["algorithm"] == "gigpo"
    # the site ran as the run's env_server role; the warm start and the workers shopped there
    assert "webshop environment" in (run / "logs" / "env_server_0.log").read_text()
    for name in ("worker_0", "learner_0"):
        assert (
            "environments use the run's webshop server at http://"
            in (run / "logs" / f"{name}.log").read_text()
        )
    infos = env_step_demonstrations(run)
    bought = [i["reward"] for i in infos if isinstance(i.get("reward"), dict)]
    assert bought and all(0.0 <= r["metrics"]["score"] <= 1.0 for r in bought)
    scalars = read_scalars(run / "tensorboard")
    for tag in ("eval/score", "rollout/score", "eval/success"):
        assert tag in scalars, sorted(scalars)
