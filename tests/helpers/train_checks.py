"""Helpers shared by the trainer and Slurm tests: a reduced quickstart and the checks of a finished run."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow.ipc as ipc

from agent_r1.train.plot import read_scalars

EXPECTED_TAGS = [
    "eval/success",
    "rollout/success",
    "rollout/reward",
    "rollout/steps_per_trajectory",
    "rollout/tool_calls_per_trajectory",
    "rollout/response_tokens_per_step",
    "loss/pg",
    "grad_norm",
    "lr",
    "entropy",
    "time/generate",
    "time/train",
    "time/idle",
    "time/learner_idle",
    "weight_sync/seconds",
    "staleness/max",
    "staleness/stale_fraction",
    "mismatch/abs_logprob_diff_rollout_learner",
    "throughput/train_tokens_per_s",
    "policy/version",
]


def reduced(
    model: Path,
    run_dir: Path,
    *extra: str,
    preset: str = "quickstart",
    build: bool = False,
    demos: int = 16,
    action_tokens: int | None = 24,
) -> list[str]:
    """A preset cut to a 2-iteration run; ``build``: the launcher builds the preset's tiny model
    at ``model`` (else ``model`` exists); ``action_tokens=None`` keeps the preset's limit."""
    return [
        f"+experiment={preset}",
        f"model.path={model}",
        f"model.build.at={model}" if build else "model.build=null",
        f"trainer.run_dir={run_dir}",
        "trainer.iterations=2",
        "trainer.eval_every=1",
        "trainer.checkpoint_every=1",
        "trainer.progress=false",
        "trainer.timeout_s=240",
        "sft.steps=3",
        f"sft.demos={demos}",
        "recipe.train_size=16",
        "recipe.test_size=4",
        "rollout.prompts_per_iteration=4",
        "rollout.group_size=4",
        *([f"episode.max_action_tokens={action_tokens}"] if action_tokens else []),
        "rollout.ready_timeout_s=120",
        # the layouts these runs test (PP/VPP, EP, vision) take the plain packing; shared prefixes
        # have tests of their own and the whole quickstart (test_stream) runs them
        "optim.share_prefix=0",
        *extra,
    ]


def train(args: list[str], timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "agent_r1.cli", "train", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def ledger(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "ledger.jsonl").read_text().splitlines() if x.strip()]


def manifest(run_dir: Path, it: int) -> dict:
    return json.loads((run_dir / "records" / f"iter_{it:06d}" / "manifest.json").read_text())


def check_finished(r: subprocess.CompletedProcess, run_dir: Path, iterations: int) -> dict:
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s = json.loads((run_dir / "summary.json").read_text())
    for k in ("eval_success_start", "eval_success_end", "wall_seconds", "iterations", "algorithm"):
        assert k in s
    assert s["iterations"] == iterations
    assert 0.0 <= s["eval_success_start"] <= 1.0 and 0.0 <= s["eval_success_end"] <= 1.0
    assert (run_dir / "checkpoints" / f"iter_{iterations - 1:06d}" / "agent_r1_state.json").exists()
    # every committed iteration was trained exactly once, on exactly the committed shards
    entries = ledger(run_dir)
    assert [e["iteration"] for e in entries] == list(range(iterations))
    for e in entries:
        m = manifest(run_dir, e["iteration"])
        assert e["shards"] == {k: v["checksum"] for k, v in m["shards"].items()}
        assert e["rows"] == m["rows"] > 0
    assert "iter " in r.stdout and "tensorboard --logdir" in r.stdout  # console line + TB command
    return s


def check_events(run_dir: Path, iterations: int, eval_every: int = 1) -> dict[str, list]:
    scalars = read_scalars(run_dir / "tensorboard")
    for tag in EXPECTED_TAGS:
        assert tag in scalars, f"{tag} missing from the event files; have {sorted(scalars)}"
        assert all(math.isfinite(v) for _, v in scalars[tag]), (tag, scalars[tag])
    assert [s for s, _ in scalars["rollout/success"]] == list(range(1, iterations + 1))
    assert [s for s, _ in scalars["eval/success"]] == list(range(0, iterations + 1, eval_every))
    return scalars


def read_records(run_dir: Path, it: int, folder: str = "records"):
    import pyarrow as pa

    d = run_dir / folder / f"iter_{it:06d}"
    return pa.concat_tables([ipc.open_file(str(p)).read_all() for p in sorted(d.glob("shard_*.arrow"))])


def start_train(args: list[str], **popen) -> subprocess.Popen:
    """`agent-r1 train` in its own session, so a test can kill -9 the whole run at once."""
    return subprocess.Popen(
        [sys.executable, "-m", "agent_r1.cli", "train", *args], start_new_session=True, **popen
    )


def wait_for(cond, timeout: float, what: str, run: subprocess.Popen | None = None, report=None) -> None:
    """Poll ``cond()`` every 50 ms until true; fail naming ``what`` after ``timeout`` seconds, or at
    once if the process ``run`` exits first; ``report()``: text the failure adds (logs)."""
    import time

    def fail(why: str):
        return AssertionError(why + (f"\n{report()}" if report else ""))

    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        if run is not None and run.poll() is not None:
            raise fail(f"the run exited with {run.returncode} before {what}")
        time.sleep(0.05)
    raise fail(f"timed out waiting for {what}")


def run_report(run_dir: Path, console: Path, chars: int = 3000) -> str:
    """The tail of a run's console output and of each role's log, for a failure message."""
    parts = []
    for f in [console, *sorted((run_dir / "logs").glob("*.log"))]:
        if f.exists():
            parts.append(f"--- {f.name} ---\n{f.read_text(errors='replace')[-chars:]}")
    return "\n".join(parts)


def run_until(
    args: list[str], run_dir: Path, ready, what: str, act, ready_timeout: float = 300, timeout: float = 300
) -> tuple[int, str]:
    """Start `agent-r1 train` on ``run_dir``, wait for ``ready()`` (up to ``ready_timeout`` s), then
    ``act(popen)`` and wait for the run to end (up to ``timeout`` s): its exit code and console output. The output goes to a file beside the run (a
    pipe nobody reads while waiting would stall the run once full); a run that exits before
    ``ready()``, or never gets there, fails with its output and its roles' logs."""
    console = run_dir.parent / f"{run_dir.name}.console"
    with console.open("w") as out:
        p = start_train(args, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(ready, ready_timeout, what, run=p, report=lambda: run_report(run_dir, console))
        act(p)
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"the run did not end within {timeout:.0f} s\n{run_report(run_dir, console)}"
            ) from None
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    return p.returncode, console.read_text(errors="replace")


def env_step_demonstrations(run_dir: Path) -> list[dict]:
    """The ``info`` of every warm-start step of an ``env_step`` recipe, after checking that each
    step recorded its state (``anchor_obs``) and every call was an error-free ``env_step``."""
    import json

    infos = [json.loads(x) for x in read_records(run_dir, 0, "sft_records").column("info").to_pylist()]
    assert all("anchor_obs" in i for i in infos)
    calls = [c for i in infos for c in i.get("tool_calls", [])]
    assert calls and all(c["name"] == "env_step" and not c.get("error") for c in calls)
    return infos


def agent_r1_eval(*args: str) -> subprocess.CompletedProcess:
    """``agent-r1 eval --no-progress ARGS``, which must succeed."""
    r = subprocess.run(
        [sys.executable, "-m", "agent_r1.cli", "eval", "--no-progress", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r


def episodes(table) -> dict[int, list[list[int]]]:
    """trajectory (by its prompt index) -> the action tokens of its steps, in order."""
    out: dict[int, list[list[int]]] = {}
    rows = sorted(table.to_pylist(), key=lambda r: (r["trajectory_id"], r["step_index"]))
    for r in rows:
        p = int(r["trajectory_id"].split("-p")[-1].split("-s")[0])
        out.setdefault(p, []).append(r["action_token_ids"])
    return out


def check_eval_reproduces(run: Path, out: Path, num_episodes: int, iterations: int = 2) -> dict:
    """``agent-r1 eval --run`` of a finished run (its newest checkpoint exported to HF, served
    greedily) generates token for token what the trainer's servers generated in its last
    evaluation from the weights the learner pushed, and reports the same success."""
    from agent_r1.records.reader import RecordStore

    r = agent_r1_eval("--run", str(run), "--out", str(out))
    metrics = json.loads((out / "metrics.json").read_text())
    summary = json.loads((run / "summary.json").read_text())
    assert metrics["success"] == summary["eval_success_end"] and metrics["episodes"] == num_episodes
    assert f"success {metrics['success']:.3f}" in r.stdout
    trainer = RecordStore(run / "eval_records").read(iterations)
    mine = RecordStore(out / "records").read(0)
    assert episodes(mine) == episodes(trainer)
    assert metrics["model"].endswith(f"iter_{iterations - 1:06d}")
    return metrics
