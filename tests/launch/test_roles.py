"""The roles of a run are declared once (``ROLES``): the local launcher, the Slurm job and
``agent-r1 role`` all read them, so a role added there is started by both launchers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from agent_r1.launch import roles
from agent_r1.launch.launcher import LocalLauncher, Proc
from agent_r1.launch.roles import ROLES, RoleSpec, role_spec, run_roles
from agent_r1.launch.slurm import render_job
from agent_r1.rollout.served import RESERVED
from agent_r1.train.config import load_config
from agent_r1.train.run_dir import RunDir


def _cfg(*extra: str):
    return load_config(["rollout.servers=2", "rollout.workers=3", "parallel.learner_ranks=2", *extra])


def _local_names(cfg, tmp_path: Path, monkeypatch) -> list[str]:
    started = []
    monkeypatch.setattr(Proc, "start", lambda self: started.append(self.name))
    LocalLauncher(cfg, RunDir.at(tmp_path / "run").create()).start()
    return started


def _slurm_roles(cfg, tmp_path: Path) -> list[str]:
    script = render_job(cfg, RunDir.at(tmp_path / "run").create())
    return re.findall(r"agent_r1\.cli role (\w+)", script)


def test_both_launchers_start_the_registrys_roles(tmp_path, monkeypatch):
    cfg = _cfg("rollout.router=true", "+rollout.helpers.judge=/models/judge")
    want = ["router", "server", "judge", "worker", "learner"]
    assert [s.name for s in run_roles(cfg)] == want
    assert _local_names(cfg, tmp_path, monkeypatch) == [
        "router_0", "server_0", "server_1", "judge_0", "worker_0", "worker_1", "worker_2", "learner_0", "learner_1",
    ]  # fmt: skip
    slurm = load_config(["cluster=slurm_cpu", "rollout.router=true", "+rollout.helpers.judge=/models/judge"])
    assert _slurm_roles(slurm, tmp_path) == want


def test_a_role_added_to_the_registry_is_started_by_both_launchers(tmp_path, monkeypatch):
    probe = RoleSpec("probe", lambda c: 2, lambda r: 0, publishes=lambda rd, _: rd.control / "probes")
    monkeypatch.setattr(roles, "ROLES", (*ROLES[:-1], probe, ROLES[-1]))
    cfg = _cfg()
    assert role_spec(cfg, "probe") is probe
    names = _local_names(cfg, tmp_path / "local", monkeypatch)
    assert names[-4:] == ["probe_0", "probe_1", "learner_0", "learner_1"]
    assert _slurm_roles(load_config(["cluster=slurm_cpu"]), tmp_path / "slurm")[-2:] == ["probe", "learner"]
    # its stale addresses go at launch, as every role's
    rd = RunDir.at(tmp_path / "local" / "run")
    assert probe.published(rd, "probe_1") == rd.control / "probes" / "probe_1.json"


def test_every_role_name_is_reserved_from_helper_models():
    assert {s.name for s in ROLES} <= set(RESERVED)
    with pytest.raises(ValueError, match="unknown role 'nope' in this run: env_server, retriever"):
        role_spec(_cfg(), "nope")
