"""Models asked by name: the run's policy servers and helper models (OPD teacher, LLM judge,
summariser), found through the addresses their roles publish, and the config that declares them."""

from __future__ import annotations

import asyncio
import json

import pytest

from agent_r1.agent_tools.services import Services
from agent_r1.rollout.served import ServedModel, helper_models, run_models
from agent_r1.train.config import load_config
from agent_r1.train.run_dir import RunDir


def test_run_models_are_found_where_their_roles_publish(tmp_path):
    cfg = load_config(["+rollout.helpers.selector=/m/judge", "algorithm.teacher=/m/teacher"])
    assert helper_models(cfg) == {"selector": "/m/judge", "teacher": "/m/teacher"}
    rd = RunDir.at(tmp_path).create()
    served = Services(models=run_models(cfg, rd)).model
    assert served("selector").urls() == [] and served("teacher").model == "/m/teacher"
    rd.helper_dir("selector").mkdir(parents=True)
    (rd.helper_dir("selector") / "selector_0.json").write_text(json.dumps({"url": "http://a:1"}))
    (rd.servers / "server_0.json").write_text(json.dumps({"url": "http://b:2"}))
    (rd.servers / "server_1.json").write_text("{half written")  # being replaced: skipped
    assert served("selector").urls() == ["http://a:1"]
    assert served("policy").urls() == ["http://b:2"] and served("policy").model == cfg.model.path
    assert rd.teachers == rd.helper_dir("teacher")


def test_an_unserved_name_says_how_to_serve_it():
    with pytest.raises(ValueError, match=r"rollout.helpers.nobody=HF_DIR"):
        Services().model("nobody")


def test_waiting_for_a_helper_that_never_comes_up_ends():
    late = ServedModel("late", "/m", lambda: [], wait_s=0.2)
    with pytest.raises(RuntimeError, match="'late' model came up within"):
        asyncio.run(late.client())


@pytest.mark.parametrize("name", ["server", "policy", "teacher", "not-an-identifier"])
def test_helper_names_that_would_clash_are_refused(name):
    with pytest.raises(Exception, match=f"rollout.helpers.{name}"):
        load_config([f"+rollout.helpers.{name}=/m"])


def test_helpers_get_a_role_on_the_rollout_nodes(tmp_path):
    from agent_r1.launch.slurm import render_job

    cfg = load_config(["+experiment=qwen3_4b_paper_search_pspo_4n8g", f"trainer.run_dir={tmp_path}/run"])
    assert cfg.recipe.env["selector"] == "llm" and set(helper_models(cfg)) == {"selector"}
    script = render_job(cfg, RunDir.at(tmp_path / "run").create())
    line = next(x for x in script.splitlines() if " role selector " in x)
    assert "--het-group=1" in line and "--supervise" in line and "--gpus-per-task=1" in line
