"""The local launcher: every role as a local process, supervised.

``agent-r1 train`` resolves the config, prepares the run directory, starts the rollout servers
(``agent-r1 serve``: the embedded engine behind SGLang's API), the rollout workers and the learner
ranks (torch.distributed over gloo), each logging to ``run_dir/logs/``. A dead server or worker is
restarted (the coordinator brings a replaced server to the current weights; a worker's task is
idempotent); a dead learner ends the run with its log's tail. The launcher owns the run directory
(``RunLock``: a second launch refuses) and its roles die with it (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent_r1.cpus import usable_cpus
from agent_r1.engine_spec import engine_spec
from agent_r1.errors import AgentR1Error, UsageError
from agent_r1.launch.roles import (
    RoleSpec,
    quiet_progress_bars_in_batch_logs,
    role_command,
    run_roles,
    stale_addresses,
)
from agent_r1.process import die_with_parent
from agent_r1.train.config import TinyModelConfig, TrainConfig, to_yaml
from agent_r1.train.run_dir import RunDir, RunLock, atomic_write_json

log = logging.getLogger("agent_r1.launcher")


def default_run_dir(cfg: TrainConfig) -> Path:
    return Path(cfg.trainer.run_dir or Path("runs") / cfg.trainer.name)


def prepare_run(cfg: TrainConfig, local: bool = True) -> RunDir:
    """Check what can be checked before any process (``preflight``), create the run directory,
    build the preset's tiny model if asked to, check the data rows, write the resolved config."""
    from agent_r1.launch.preflight import data_problems, model_problems, raise_problems, retrieval_problems
    from agent_r1.records.shard import iteration_dir

    raise_problems(model_problems(cfg, local) + retrieval_problems(cfg))
    rd = RunDir.at(default_run_dir(cfg)).create()
    if cfg.trainer.resume == "never" and (
        iteration_dir(rd.records, 0).exists() or (rd.root / "sft_records").exists()
    ):
        raise AgentR1Error(
            f"{rd.root} already has records and trainer.resume=never: choose another trainer.run_dir"
        )
    quiet_progress_bars_in_batch_logs()  # building the tiny model writes shards
    ensure_model(cfg)
    ensure_index(cfg)
    raise_problems(data_problems(cfg, rd))
    rd.config.write_text(to_yaml(cfg))
    rd.stop_flag.unlink(missing_ok=True)
    return rd


def ensure_model(cfg: TrainConfig) -> None:
    """Build the preset's tiny model at ``model.build.at`` when it is missing (pre-flight has
    refused any other missing ``model.path``)."""
    path = Path(cfg.model.path)
    if (path / "config.json").exists():
        return
    if cfg.model.build is None:
        raise AgentR1Error(f"model.path {path} has no config.json (and model.build is not set)")
    log.info("building tiny model at %s", path)
    build_model(cfg.model.build, path)


def build_model(b: TinyModelConfig, out: Path) -> Path:
    """A tiny random model of ``b``'s shape whose tokenizer is trained on its recipe's text and
    tool schemas (``model.build``; ``tools/make_tiny_model.py`` builds one from its flags)."""
    from agent_r1.models.tiny import build_tiny_model
    from recipes import load_recipe

    recipe = load_recipe(b.recipe)
    return build_tiny_model(
        out, recipe.corpus(), recipe.tool_schemas(), b.arch, b.vocab_size, b.hidden, b.layers, b.heads,
        b.kv_heads, seed=b.seed, chat_format=b.chat_format, split_digits=b.split_digits,
    )  # fmt: skip


def ensure_index(cfg: TrainConfig) -> None:
    """Build ``retrieval.index`` from the recipe's passages when it is missing, or when the recipe
    built it for other data (another seed or dataset files); an index built from a user's own
    corpus is never replaced."""
    r = cfg.retrieval
    if not r.index or not r.build:
        return
    from agent_r1.retrieval.index import build_index, read_meta
    from recipes import load_recipe

    paths = [p for p in (cfg.recipe.train_path, cfg.recipe.test_path) if p]
    source = f"recipe {cfg.recipe.name} seed {cfg.recipe.seed} files {paths} options {cfg.recipe.options}"
    meta = read_meta(r.index)
    if meta is not None and (not meta["source"].startswith("recipe ") or meta["source"] == source):
        if meta.get("dense") or not r.dense:
            return
    recipe = load_recipe(cfg.recipe.name)
    log.info("building the retrieval index at %s (%s)", r.index, source)
    passages = recipe.passages(seed=cfg.recipe.seed, paths=paths, **cfg.recipe.options)
    build_index(passages, r.index, dense=r.dense, source=source)


@dataclass
class Proc:
    name: str
    cmd: list[str]
    env: dict[str, str]
    log_path: Path
    restartable: bool
    console: bool = False
    popen: subprocess.Popen | None = None
    restarts: int = 0
    log_file: Any = field(default=None, repr=False)
    published: Path | None = None  # the address it publishes (removed when it is restarted)
    cpus: list[int] | None = None  # pinned to these CPUs (``cluster.local_cpus``), with its threads

    def start(self) -> None:
        die_with_me = pinned(die_with_parent(), self.cpus)  # a killed launcher leaves no role behind
        if self.console:  # rank 0 shows the progress bars and the per-iteration line
            self.popen = subprocess.Popen(
                self.cmd, env=self.env, start_new_session=False, preexec_fn=die_with_me
            )
        else:
            self.log_file = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
            self.popen = subprocess.Popen(
                self.cmd,
                env=self.env,
                stdout=self.log_file,
                stderr=subprocess.STDOUT,
                start_new_session=False,
                preexec_fn=die_with_me,
            )

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(sig)

    def wait(self, timeout: float) -> None:
        if self.popen is None:
            return
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
        if self.log_file is not None:
            self.log_file.close()


def pinned(preexec: Any, cpus: list[int] | None) -> Any:
    """``preexec`` then, in the child before exec, its CPU affinity set to ``cpus`` (every thread
    it starts inherits it, and ``cpus.usable_cpus`` sizes its thread pools from it)."""
    if not cpus:
        return preexec

    def child() -> None:
        if preexec is not None:
            preexec()
        os.sched_setaffinity(0, cpus)

    return child


def tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


class LocalLauncher:
    def __init__(self, cfg: TrainConfig, rd: RunDir, threads_per_learner: int = 1):
        self.cfg, self.rd = cfg, rd
        self.procs: list[Proc] = []
        self.launch = uuid.uuid4().hex[:12]
        base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "PMIX_"))}
        base.update(
            AGENT_R1_LAUNCH_ID=self.launch,
            AGENT_R1_HOST="127.0.0.1",
            AGENT_R1_LAUNCHER="local",
            PYTHONUNBUFFERED="1",
        )
        self.base_env = base
        self.threads = threads_per_learner

    def add(self, spec: RoleSpec, name: str, index: int | None, extra_env=None, console=False):
        env = dict(self.base_env, **(extra_env or {}))
        cmd = role_command(spec.name, self.rd.root, index)
        log_path, published = self.rd.logs / f"{name}.out", spec.published(self.rd, name)
        cpus = self.cfg.cluster.local_cpus.get(spec.name)
        self.procs.append(
            Proc(name, cmd, env, log_path, not spec.learner, console, published=published, cpus=cpus)
        )

    def start(self) -> None:
        cfg = self.cfg
        self.rd.new_api_key()  # every server of this launch requires it; every client reads it
        atomic_write_json(
            self.rd.control / "launch.json",
            {"launch_id": self.launch, "time": time.time(), "launcher": "local"},
        )
        usable = os.sched_getaffinity(0)
        for kind, cpus in cfg.cluster.local_cpus.items():
            if not set(cpus) <= usable:
                raise UsageError(
                    f"cluster.local_cpus.{kind}={cpus}: this process may only use CPUs {sorted(usable)}"
                )
        spec = engine_spec(cfg.rollout.engine)
        if spec.needs_gpu:
            raise UsageError(
                f"rollout.engine={spec.name} needs GPU nodes: use `agent-r1 launch` on a Slurm cluster"
            )
        for stale in stale_addresses(cfg, self.rd):
            stale.unlink(missing_ok=True)  # addresses of a previous launch
        self.rd.shutdown_flag.unlink(missing_ok=True)
        if spec.serving == "none":  # servers the run does not start
            for i, url in enumerate(cfg.rollout.urls):
                atomic_write_json(self.rd.servers / f"external_{i}.json", {"url": url})
        for spec in run_roles(cfg):
            n = spec.count(cfg)
            for i in range(n):
                if not spec.learner:
                    self.add(spec, f"{spec.name}_{i}", i)
                    continue
                env = {
                    "AGENT_R1_RANK": str(i),
                    "AGENT_R1_WORLD": str(n),
                    "AGENT_R1_LOCAL_RANK": str(i),
                    "AGENT_R1_THREADS": str(self.threads),
                }
                self.add(spec, f"{spec.name}_{i}", None, extra_env=env, console=i == 0)
        for p in self.procs:
            p.start()
        log.info("started %s (logs in %s)", ", ".join(p.name for p in self.procs), self.rd.logs)

    def supervise(self, poll_s: float = 0.5) -> int:
        """Until learner rank 0 exits: restart dead servers/workers, fail on a dead learner."""
        learners = [p for p in self.procs if p.name.startswith("learner_")]
        while True:
            rc0 = learners[0].popen.poll()
            if rc0 is not None:
                others = [p.popen.wait() for p in learners[1:]]
                bad = [(p, rc) for p, rc in zip(learners[1:], others, strict=True) if rc not in (0, 3)]
                if rc0 not in (0, 3) or bad:
                    culprit = learners[0] if rc0 not in (0, 3) else bad[0][0]
                    sys.stderr.write(
                        f"\n{culprit.name} failed; last lines of {self.rd.logs / (culprit.name + '.log')}:\n"
                    )
                    sys.stderr.write(tail(self.rd.logs / f"{culprit.name}.log") + "\n")
                    return rc0 or bad[0][1]
                return rc0
            for p in learners[1:]:
                rc = p.popen.poll()
                if rc not in (None, 0, 3):
                    sys.stderr.write(
                        f"\n{p.name} exited with {rc}; last lines of its log:\n{tail(self.rd.logs / (p.name + '.log'))}\n"
                    )
                    return rc
            for p in self.procs:
                if p.restartable and p.popen.poll() is not None and not self.rd.stopping:
                    p.restarts += 1
                    if p.restarts > 5:
                        sys.stderr.write(
                            f"\n{p.name} died {p.restarts} times; last lines:\n{tail(p.log_path)}\n"
                        )
                        return 1
                    log.warning(
                        "%s exited with %s; restarting it (%d)", p.name, p.popen.returncode, p.restarts
                    )
                    if p.published is not None:  # its address is dead; the new one publishes anew
                        p.published.unlink(missing_ok=True)
                    p.start()
            time.sleep(poll_s)

    def stop_gracefully(self, timeout_s: float) -> int:
        """Ctrl-C or SIGTERM: ask the learners to checkpoint and exit (the STOP file), wait for
        them; a second Ctrl-C ends the run at once. Learner rank 0's exit code (3 = checkpointed)."""
        sys.stderr.write(
            "\nstopping: the learners checkpoint what is trained and exit (Ctrl-C again to stop at once)\n"
        )
        self.rd.request_stop()
        learners = [p for p in self.procs if p.name.startswith("learner_") and p.popen is not None]
        deadline = time.time() + timeout_s
        try:
            while any(p.popen.poll() is None for p in learners) and time.time() < deadline:
                time.sleep(0.2)
        except KeyboardInterrupt:
            return 130
        rc = learners[0].popen.poll() if learners else None
        return 130 if rc is None else rc

    def shutdown(self) -> None:
        self.rd.request_stop()
        for p in self.procs:
            p.stop()
        for p in self.procs:
            p.wait(20)


def train_local(cfg: TrainConfig) -> int:
    """``agent-r1 train``: the whole run on this machine."""

    t0 = time.time()
    lock = RunLock(RunDir.at(default_run_dir(cfg)).create()).acquire()  # held until this process exits
    rd = prepare_run(cfg)
    # roles alternate in sync mode: the learner ranks share the cores this process may use
    threads = max(1, usable_cpus() // cfg.parallel.learner_ranks)
    launcher = LocalLauncher(cfg, rd, threads_per_learner=threads)
    print(
        f"run dir: {rd.root}\nlogs:    {rd.logs}\nTensorBoard: tensorboard --logdir {rd.tensorboard}",
        flush=True,
    )
    # Ctrl-C and SIGTERM: checkpoint, then stop (also when started with SIGINT ignored, as a
    # background job of a non-interactive shell is)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        try:
            launcher.start()
            rc = launcher.supervise()
        except KeyboardInterrupt:
            rc = launcher.stop_gracefully(cfg.trainer.timeout_s)
    finally:
        launcher.shutdown()
        lock.release()
    s = rd.read_summary()
    if s:
        s["launch_seconds"] = round(time.time() - t0, 1)  # this launch, model build and start-up included
        atomic_write_json(rd.summary, s)
    if rc == 0 and s:
        png = None
        if cfg.trainer.plot:
            from agent_r1.train.plot import plot_run

            png = plot_run(rd.tensorboard, rd.root / "curve.png")
        print(
            f"\ndone in {time.time() - t0:.0f} s: held-out success {s.get('eval_success_start')} -> "
            f"{s.get('eval_success_end')} over {s.get('iterations')} iterations ({s.get('algorithm')})\n"
            f"summary:     {rd.summary}\n"
            f"TensorBoard: tensorboard --logdir {rd.tensorboard}\n"
            + (f"curve:       {png}\n" if png else ""),
            flush=True,
        )
    elif rc == 3:
        done = s.get("iterations", 0) if s else 0
        print(
            f"\nstopped after {done} trained iteration(s), checkpointed in {rd.checkpoints}; the same "
            "command resumes the run (trainer.resume=auto)",
            flush=True,
        )
    return rc
