"""The run's environment server as its environments see it: the address is read again for every
episode, so a server the launcher restarted (on a new port) is found; while it restarts, the last
address stands. Environments get it in the ``Services`` they are given, nowhere else."""

from __future__ import annotations

import json

import pytest

from agent_r1.agent_tools.services import Services
from agent_r1.train.config import load_config
from agent_r1.train.env_server import run_env_server
from agent_r1.train.run_dir import RunDir


def test_environments_follow_a_restarted_server(tmp_path):
    from recipes.webshop import env as webshop

    cfg = load_config(["+experiment=webshop_steppo", "rollout.env_server=true"])
    rd = RunDir.at(tmp_path)
    rd.env_server_file.parent.mkdir(parents=True)
    rd.api_key_file.parent.mkdir(parents=True, exist_ok=True)
    rd.api_key_file.write_text("k3y")
    rd.env_server_file.write_text(json.dumps({"url": "http://127.0.0.1:41001"}))
    services = Services(env_server=run_env_server(cfg, rd))
    assert webshop.server_url("run", services) == ("http://127.0.0.1:41001", "k3y")
    rd.env_server_file.unlink()  # the launcher removes it when the server dies ...
    assert webshop.server_url("run", services)[0] == "http://127.0.0.1:41001"
    rd.env_server_file.write_text(json.dumps({"url": "http://127.0.0.1:41777"}))  # ... and it is back
    assert webshop.server_url("run", services)[0] == "http://127.0.0.1:41777"
    assert webshop.server_url("http://elsewhere:1", services) == ("http://elsewhere:1", None)  # kept
    with pytest.raises(ValueError, match="server=run, but this episode was given no environment server"):
        webshop.server_url("run", Services())
    assert run_env_server(load_config(["+experiment=webshop_steppo"]), rd) is None  # not asked for
