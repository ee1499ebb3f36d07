"""Faults of a whole `agent-r1 train` run that lose nothing: the only rollout server killed
mid-rollout, the launcher itself killed, a second launcher on a live run, a corrupted checkpoint (and
a torn record shard of the iteration it redoes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

from train_checks import check_finished, ledger, manifest, reduced, run_until, start_train, train, wait_for


def _processes_of(run: Path) -> list[tuple[int, str]]:
    """(pid, command line) of every live process whose command line names the run directory."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = next(x for x in (d / "status").read_text().splitlines() if x.startswith("State:"))
        except (OSError, StopIteration):
            continue
        if str(run) in cmd and "Z" not in state.split()[1]:
            out.append((int(d.name), cmd))
    return out


def _role_pid(run: Path, name: str) -> int:
    return json.loads((run / "control" / "roles" / f"{name}.json").read_text())["pid"]


def _kill_server_0_mid_rollout(run: Path, args: list[str]) -> str:
    """Run ``args``, SIGKILL ``server_0`` once the first rollout is under way; the run's output
    (it must finish with 0)."""
    rc, out = run_until(
        args,
        run,
        (run / "control" / "tasks" / "train_000000.w0.progress").exists,
        "the first rollout",
        lambda _: os.kill(_role_pid(run, "server_0"), signal.SIGKILL),
    )
    assert rc == 0, out[-4000:]
    assert "server_0 exited" in out and "restarting" in out
    for it in range(2):  # every episode of every iteration made it, each iteration trained once
        assert manifest(run, it)["num_trajectories"] == 4 * 4
    assert [e["iteration"] for e in ledger(run)] == [0, 1]
    return out


def test_only_server_killed_mid_rollout_run_finishes(tiny_model_dir, tmp_path):
    """The replacement server starts from the model on disk; the coordinator brings it to the
    current weights, the worker runs its share again on it, nothing is lost or trained twice."""
    run = tmp_path / "onlyserver"
    args = reduced(tiny_model_dir, run, "rollout.servers=1", "episode.max_action_tokens=48")
    _kill_server_0_mid_rollout(run, args)
    coord = (run / "logs" / "learner_0.log").read_text()
    assert "lack weight version" in coord  # the replacement was brought to the current weights


def test_killed_launcher_leaves_no_process_and_the_same_command_resumes(tiny_model_dir, tmp_path):
    run = tmp_path / "launcherkill"
    args = reduced(tiny_model_dir, run, "trainer.iterations=3")
    p = start_train(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: (run / "ledger.jsonl").exists() and ledger(run), 300, "iteration 0 trained")
        assert len(_processes_of(run)) >= 3  # launcher, server, worker, learner
        os.kill(p.pid, signal.SIGKILL)  # the launcher alone, as the OOM killer would
        p.wait(10)
        wait_for(lambda: not _processes_of(run), 10, f"the roles to die: {_processes_of(run)}")
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    r = train(args)
    check_finished(r, run, 3)
    assert [e["iteration"] for e in ledger(run)] == [0, 1, 2]  # complete, each once


def test_second_launcher_on_a_live_run_refuses(tiny_model_dir, tmp_path):
    run = tmp_path / "twice"
    args = reduced(tiny_model_dir, run)
    p = start_train(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for((run / "control" / "tasks" / "train_000000.json").exists, 300, "the first task")
        config_before = (run / "config.yaml").read_text()
        r = train(args, timeout=120)
        assert r.returncode == 2
        assert "is in use by agent-r1 train" in r.stderr and f"pid {p.pid}" in r.stderr, r.stderr
        assert (run / "config.yaml").read_text() == config_before  # it touched nothing
        assert p.wait(300) == 0  # the live run is unharmed
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert [e["iteration"] for e in ledger(run)] == [0, 1]


def test_corrupted_checkpoint_is_refused_and_the_previous_one_used(tiny_model_dir, tmp_path):
    run = tmp_path / "corrupt"
    args = reduced(tiny_model_dir, run, "trainer.keep_checkpoints=3")
    check_finished(train(args), run, 2)
    newest = run / "checkpoints" / "iter_000001"
    assert (newest / "checksums.json").exists()
    shard = max((p for p in newest.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    with shard.open("r+b") as f:  # 4 KiB of float32 NaN in the middle of the largest shard
        f.seek(shard.stat().st_size // 2)
        f.write(b"\x00\x00\xc0\x7f" * 1024)
    (run / "checkpoints" / "iter_000002.tmp").mkdir()  # an interrupted save
    # iteration 1 is redone from iteration 0's checkpoint: its committed shard, torn, is generated
    # again (it stopped every rerun with a clear line and no way forward)
    torn = run / "records" / "iter_000001" / "shard_w0000.arrow"
    torn.write_bytes(torn.read_bytes()[:100])
    r = train([*args[:-1], "trainer.keep_checkpoints=3", "trainer.iterations=3"])
    check_finished(r, run, 3)
    log = (run / "logs" / "learner_0.log").read_text()
    assert "iteration 1 is redone: dropping its damaged shard" in log and str(torn) in log
    assert manifest(run, 1)["num_trajectories"] == manifest(run, 0)["num_trajectories"]
    assert f"{shard.name} does not match its checksum" in log and "falling back" in log
    assert "resumed from" in log and "iter_000000" in log.split("resumed from")[1].splitlines()[0]
    assert (run / "checkpoints" / "iter_000001.corrupt").is_dir()  # kept for inspection
    assert not (run / "checkpoints" / "iter_000002.tmp").exists()
    # iteration 1 was trained again from iteration 0's weights (with its committed records); the
    # ledger holds each iteration once
    assert [e["iteration"] for e in ledger(run)] == [0, 1, 2]


def test_router_in_front_of_the_servers_and_a_restarted_server_rejoins(tiny_model_dir, tmp_path):
    """rollout.router=true: the real sglang-router starts first, every server registers with it,
    workers send /generate through it; a killed server's replacement registers again. The run has
    more iterations than it needs and is stopped (the STOP file, as Ctrl-C) only once the
    replacement has registered: how fast a replacement starts beside other work never decides the
    outcome (the other server carries the run meanwhile)."""
    run = tmp_path / "router"
    args = reduced(
        tiny_model_dir, run, "rollout.router=true", "rollout.servers=2", "episode.max_action_tokens=48",
        "trainer.iterations=1000", "trainer.eval_every=0", "trainer.checkpoint_every=0",
    )  # fmt: skip
    log0 = run / "logs" / "server_0.log"

    def kill_server_0_then_stop_once_it_rejoins(p: subprocess.Popen) -> None:
        os.kill(_role_pid(run, "server_0"), signal.SIGKILL)
        wait_for(
            lambda: log0.read_text().count("registered with the router") >= 2,
            300,
            "server_0's replacement to register with the router",
            run=p,
        )
        (run / "control" / "STOP").write_text("test")

    rc, out = run_until(
        args,
        run,
        (run / "control" / "tasks" / "train_000000.w0.progress").exists,
        "the first rollout",
        kill_server_0_then_stop_once_it_rejoins,
    )
    assert rc == 3, out[-4000:]  # stopped, checkpointed
    assert "server_0 exited" in out and "restarting" in out
    router = json.loads((run / "control" / "router.json").read_text())["url"]
    assert log0.read_text().count(f"registered with the router {router}") == 2  # first start and the restart
    assert f"registered with the router {router}" in (run / "logs" / "server_1.log").read_text()
    trained = [e["iteration"] for e in ledger(run)]
    assert trained == list(range(len(trained))) and trained  # each trained once, in order
    for it in trained:  # every episode of every trained iteration made it
        assert manifest(run, it)["num_trajectories"] == 4 * 4
