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


def test_learner_rank_0_hosts_the_store_on_the_port_it_bound_and_the_others_reach_it(tmp_path):
    """The learners' rendezvous never picks a port and binds it later (another process could take it
    in between, as a busy machine's outgoing connections did): rank 0's store binds port 0 and
    publishes the port it got; rank 1, started first, waits for the file and connects."""
    import json
    import threading

    from agent_r1.launch.roles import RoleEnv, rendezvous

    rd = RunDir.at(tmp_path / "run").create()
    env = {r: RoleEnv(r, 2, r, "AGENT_R1_RANK", "127.0.0.1", "launch-a") for r in (0, 1)}
    got = {}
    waiter = threading.Thread(target=lambda: got.update(one=rendezvous(rd, env[1], 60)))
    waiter.start()
    master = rendezvous(rd, env[0], 60)
    waiter.join(60)
    published = json.loads((rd.control / "learner_master.json").read_text())
    assert published == {"address": "127.0.0.1", "port": master.port, "launch_id": "launch-a"}
    got["one"].set("from rank 1", "hello")
    assert master.get("from rank 1") == b"hello"


def test_a_learner_rank_waits_only_for_its_own_launchs_master(tmp_path):
    from agent_r1.errors import RoleTimeout
    from agent_r1.launch.roles import RoleEnv, rendezvous
    from agent_r1.train.run_dir import atomic_write_json

    rd = RunDir.at(tmp_path / "run").create()
    atomic_write_json(
        rd.control / "learner_master.json", {"address": "127.0.0.1", "port": 1, "launch_id": "old"}
    )
    with pytest.raises(RoleTimeout, match="did not publish .* for launch new"):
        rendezvous(rd, RoleEnv(1, 2, 1, "AGENT_R1_RANK", "127.0.0.1", "new"), 0.3)
