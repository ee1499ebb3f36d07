"""Role bootstrap: who am I (rank, world, local rank), where am I (node address), who is the master.

The same roles run under the local launcher, under ``srun`` (Slurm's environment), under
``mpirun`` (Open MPI's environment) or ``torchrun`` (its variables). Learner rank 0 publishes its
rendezvous address in the run directory; the other ranks wait for it (with a timeout and a
message that names the file), so no hostnames have to be known in advance.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent_r1.cpus import usable_cpus
from agent_r1.engine_spec import engine_spec
from agent_r1.errors import RoleTimeout
from agent_r1.rollout.served import helper_models
from agent_r1.train.run_dir import RunDir, atomic_write_json, node_address, read_json

log = logging.getLogger("agent_r1.roles")

# (rank, world, local rank) variables, first match wins
_ENV_SOURCES = [
    ("AGENT_R1_RANK", "AGENT_R1_WORLD", "AGENT_R1_LOCAL_RANK"),  # local launcher
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),  # srun (per het-job component)
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),  # mpirun
    ("PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK"),
    ("RANK", "WORLD_SIZE", "LOCAL_RANK"),  # torchrun
]


@dataclass(frozen=True)
class RoleEnv:
    rank: int
    world: int
    local_rank: int
    source: str  # which environment it came from
    address: str  # this node's address, reachable by the other nodes
    launch_id: str  # identifies this launch (a requeued job is a new launch)


def launch_id() -> str:
    if os.environ.get("AGENT_R1_LAUNCH_ID"):
        return os.environ["AGENT_R1_LAUNCH_ID"]
    if os.environ.get("SLURM_JOB_ID"):
        return f"slurm-{os.environ['SLURM_JOB_ID']}-{os.environ.get('SLURM_RESTART_COUNT', '0')}"
    return f"pid-{os.getppid()}"


def detect() -> RoleEnv:
    for r, w, lr in _ENV_SOURCES:
        if r in os.environ and w in os.environ:
            rank, world = int(os.environ[r]), int(os.environ[w])
            if not 0 <= rank < world:
                raise ValueError(f"{r}={rank} outside {w}={world}")
            return RoleEnv(rank, world, int(os.environ.get(lr, "0")), r, node_address(), launch_id())
    return RoleEnv(0, 1, 0, "none", node_address(), launch_id())


def rendezvous(rd: RunDir, env: RoleEnv, timeout_s: float) -> Any:
    """The learner ranks' ``TCPStore`` for this launch. Rank 0 hosts it on a port the kernel picks
    as it binds (no window in which another process can take a port chosen earlier) and publishes
    where; the other ranks wait for the file and connect."""
    import datetime

    import torch.distributed as dist

    path = rd.control / "learner_master.json"
    timeout = datetime.timedelta(seconds=timeout_s)
    if env.rank == 0:
        store = dist.TCPStore(
            env.address, 0, env.world, is_master=True, timeout=timeout, wait_for_workers=False
        )
        atomic_write_json(path, {"address": env.address, "port": store.port, "launch_id": env.launch_id})
        return store
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if path.exists():
            m = read_json(path)
            if m.get("launch_id") == env.launch_id:
                return dist.TCPStore(
                    m["address"], int(m["port"]), env.world, is_master=False, timeout=timeout
                )
        time.sleep(0.1)
    raise RoleTimeout(
        f"learner rank {env.rank}: rank 0 did not publish {path} for launch {env.launch_id} within {timeout_s:.0f} s"
    )


def _file_logging(rd: RunDir, name: str) -> None:
    root = logging.getLogger("agent_r1")
    h = logging.FileHandler(rd.logs / f"{name}.log")
    h.setFormatter(logging.Formatter(f"[%(asctime)s {name}] %(levelname)s %(message)s", "%H:%M:%S"))
    root.addHandler(h)


@dataclass(frozen=True)
class RoleRun:
    """What a role's body gets: the run, this process's place in it, its name (``server_0``)."""

    cfg: Any
    rd: RunDir
    env: RoleEnv
    index: int
    name: str
    role: str


@dataclass(frozen=True)
class RoleSpec:
    """One kind of process a run starts. Both launchers (local processes, Slurm job steps) and
    ``agent-r1 role`` read these; adding a role is one entry of ``ROLES``."""

    name: str
    count: Callable[[Any], int]  # how many this run starts (0: none)
    run: Callable[[RoleRun], int]  # the body, in the role's own process
    # where its instances publish their address: a folder of NAME_i.json, or one file (stale at
    # launch and when an instance is restarted); None: nothing published
    publishes: Callable[[RunDir, str], Path] | None = None
    gpus: Callable[[Any], int] = lambda cfg: 0  # per task, on a cluster with GPUs
    single: bool = False  # one instance, index 0 (no rank from the launcher)
    learner: bool = False  # the learner ranks: not restarted, placed on the learner nodes

    def published(self, rd: RunDir, instance: str) -> Path | None:
        """The file instance ``instance`` (``server_0``) publishes, if any."""
        if self.publishes is None:
            return None
        where = self.publishes(rd, self.name)
        return where / f"{instance}.json" if where.suffix != ".json" else where

    def stale(self, rd: RunDir) -> list[Path]:
        """Addresses a previous launch left (every instance's)."""
        if self.publishes is None:
            return []
        where = self.publishes(rd, self.name)
        return list(where.glob("*.json")) if where.suffix != ".json" else [where]


def _serve_embedded(r: RoleRun, model: str, ready: Path, engine: str) -> int:
    from agent_r1.engines.embedded.server import serve

    cfg, rd = r.cfg, r.rd
    serve(
        model,
        r.env.address,
        0,
        str(ready),
        dtype=cfg.model.dtype,
        max_len=cfg.model.max_len,
        threads=cfg.rollout.server_cpus,
        batch_invariant=cfg.trainer.deterministic,  # the same bits whatever the batch
        api_key=rd.api_key(),
        # every worker's episodes may reach one server through one address (a router's): never refused
        max_client_requests=max(1024, 2 * cfg.rollout.workers * cfg.rollout.max_concurrency),
        strict=True,  # the run uses only what real SGLang serves
        stop_when=lambda: rd.shutdown_flag.exists(),
        on_ready=_join_router(cfg, rd) if r.role == "server" else None,
    )
    return 0


def _serve_upstream(r: RoleRun, model: str, ready: Path, engine: str) -> int:
    """An upstream engine's server as a child process (its launch flags: ``rollout.<engine>``)."""
    cfg, rd = r.cfg, r.rd
    run = engine_spec(engine).load("launcher")
    return run(
        model, r.env.address, ready, rd.logs / f"{r.name}.{engine}.log", cfg.model.max_len, cfg.model.dtype,
        getattr(cfg.rollout, engine), cfg.rollout.ready_timeout_s, rd.api_key(),
        stop_when=lambda: rd.shutdown_flag.exists(),
    )  # fmt: skip


# how an engine is served (``EngineSpec.serving``) -> the body of its server role
SERVING = {"in_process": _serve_embedded, "child_process": _serve_upstream}


def _serve_model(r: RoleRun) -> int:
    """A policy server (``server``) or a helper model's server, on the run's engine (helper models
    speak SGLang's API: an engine that does not serves them on its ``helper_engine``)."""
    cfg, rd = r.cfg, r.rd
    if r.role == "server":
        engine, folder, model = cfg.rollout.engine, rd.servers, cfg.model.path
    else:
        engine = engine_spec(cfg.rollout.engine).helper_engine or cfg.rollout.engine
        folder, model = rd.helper_dir(r.role), helper_models(cfg)[r.role]
    return SERVING[engine_spec(engine).serving](r, model, folder / f"{r.name}.json", engine)


def _router(r: RoleRun) -> int:
    from agent_r1.rollout.router import run_router

    c = r.cfg.rollout
    return run_router(
        r.env.address,
        r.rd.router_file,
        r.rd.logs / f"{r.name}.router.log",
        c.router_policy,
        r.rd.api_key(),
        c.ready_timeout_s,
        stop_when=lambda: r.rd.shutdown_flag.exists(),
    )


def _retriever(r: RoleRun) -> int:
    from agent_r1.retrieval.server import serve_retriever

    c = r.cfg.retrieval
    return serve_retriever(
        c.index, r.env.address, 0, r.rd.retriever_file, r.rd.api_key(), c.mode,
        stop_when=lambda: r.rd.shutdown_flag.exists(),
    )  # fmt: skip


def _env_server(r: RoleRun) -> int:
    from agent_r1.train.env_server import serve_env

    return serve_env(
        r.cfg, r.env.address, 0, r.rd.env_server_file, r.rd.api_key(), lambda: r.rd.shutdown_flag.exists()
    )


def _worker(r: RoleRun) -> int:
    import torch

    from agent_r1.train.worker import Worker

    torch.set_num_threads(1)
    Worker(r.cfg, r.rd, r.index).serve_forever()
    return 0


def _server_gpus(cfg: Any) -> int:
    """GPUs per policy server: an upstream engine's tensor-parallel size (``rollout.<engine>.tp``),
    else one."""
    upstream = getattr(cfg.rollout, cfg.rollout.engine, None)
    return getattr(upstream, "tp", 1)


# in start order: the services workers and servers need come up first (servers join the router)
ROLES: tuple[RoleSpec, ...] = (
    RoleSpec("env_server", lambda c: int(c.rollout.env_server), _env_server,
             publishes=lambda rd, _: rd.env_server_file, single=True),
    RoleSpec("retriever", lambda c: int(bool(c.retrieval.index and c.retrieval.serve)), _retriever,
             publishes=lambda rd, _: rd.retriever_file, single=True),
    RoleSpec("router", lambda c: int(c.rollout.router), _router, publishes=lambda rd, _: rd.router_file, single=True),
    RoleSpec("server", lambda c: c.rollout.servers if engine_spec(c.rollout.engine).serving != "none" else 0,
             _serve_model,
             publishes=lambda rd, _: rd.servers, gpus=_server_gpus),
    RoleSpec("worker", lambda c: c.rollout.workers, _worker),
    RoleSpec("learner", lambda c: c.parallel.learner_ranks, lambda r: _learner(r.cfg, r.rd, r.env),
             gpus=lambda c: 1, learner=True),
)  # fmt: skip


def helper_role(name: str) -> RoleSpec:
    """The server of a helper model (the OPD teacher, an LLM judge, a summariser): one GPU each."""
    return RoleSpec(name, lambda c: int(name in helper_models(c)), _serve_model,
                    publishes=lambda rd, n: rd.helper_dir(n), gpus=lambda c: 1, single=True)  # fmt: skip


def run_roles(cfg: Any) -> list[RoleSpec]:
    """The roles this run starts, in start order (helper models right after the policy servers)."""
    specs: list[RoleSpec] = []
    for s in ROLES:
        specs.append(s)
        if s.name == "server":  # what the workers ask besides the policy: up before them
            specs += [helper_role(h) for h in helper_models(cfg)]
    return [s for s in specs if s.count(cfg) > 0]


def stale_addresses(cfg: Any, rd: RunDir) -> list[Path]:
    """Addresses a previous launch of the run may have left, of every role (run now or not)."""
    return [p for spec in (*ROLES, *run_roles(cfg)) for p in spec.stale(rd)]


def role_spec(cfg: Any, role: str) -> RoleSpec:
    for s in ROLES:
        if s.name == role:
            return s
    if role in helper_models(cfg):
        return helper_role(role)
    known = ", ".join([s.name for s in ROLES] + list(helper_models(cfg)))
    raise ValueError(f"unknown role {role!r} in this run: {known}")


def run_role(role: str, run_dir: str, index: int | None = None) -> int:
    """``agent-r1 role ROLE --run-dir D``: one of ``ROLES`` or a helper model of the run (e.g.
    ``teacher`` or ``selector``)."""
    from agent_r1.logging import setup_logging
    from agent_r1.train.config import from_yaml

    rd = RunDir.at(run_dir)
    cfg = from_yaml(rd.config)
    spec = role_spec(cfg, role)
    env = detect()
    idx = env.rank if index is None else index
    name = f"{role}_{idx}"
    setup_logging(name)
    _file_logging(rd, name)
    quiet_progress_bars_in_batch_logs()
    rd.publish_role(
        name,
        {
            "host": socket.gethostname(),
            "node": os.environ.get("SLURMD_NODENAME", socket.gethostname()),
            "address": env.address,
            "pid": os.getpid(),
            "env": env.source,
            "launch_id": env.launch_id,
        },
    )
    if spec.learner:
        import warnings

        # Megatron announces its CPU fallbacks once per module; torch deprecations inside Megatron
        warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*not installed.*")
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", message=".*cuda_graph_scope.*")
        warnings.filterwarnings("ignore", message=".*non-leaf Tensor.*")
    elif os.environ.get("AGENT_R1_LAUNCHER") == "local":
        import signal

        # Ctrl-C reaches the whole process group: the launcher turns it into a stop request and
        # stops servers and workers itself once the learners have checkpointed
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    return spec.run(RoleRun(cfg, rd, env, idx, name, role))


def _join_router(cfg: Any, rd: RunDir):
    """A server's ``on_ready``: register with the run's router (when ``rollout.router``)."""
    if not cfg.rollout.router:
        return None

    def join(url: str) -> None:
        from agent_r1.http_service import follow_published
        from agent_r1.rollout.router import register

        router = follow_published(rd.router_file, cfg.rollout.ready_timeout_s, "router")()
        register(router, url, rd.api_key())

    return join


def _learner(cfg: Any, rd: RunDir, env: RoleEnv) -> int:
    import datetime

    import torch
    import torch.distributed as dist

    from agent_r1.learner.backend import bind_local_gpu
    from agent_r1.train.loop import run_learner

    if env.world != cfg.parallel.learner_ranks:
        raise ValueError(
            f"{env.world} learner ranks started but parallel.learner_ranks={cfg.parallel.learner_ranks}"
        )
    # the local launcher's share, never more than the cores this process may use (cluster.local_cpus
    # pins it); else those cores
    threads = os.environ.get("AGENT_R1_THREADS")
    torch.set_num_threads(max(1, min(int(threads), usable_cpus())) if threads else usable_cpus())
    bind_local_gpu(env.local_rank)  # before anything touches CUDA: NCCL and Megatron use this device
    lock = None
    if env.rank == 0 and os.environ.get("AGENT_R1_LAUNCHER") != "local":  # local: the launcher owns it
        from agent_r1.train.run_dir import RunLock

        lock = RunLock(rd).acquire(f"learner rank 0 of {env.launch_id}")
    dist.init_process_group(
        cfg.parallel.backend,
        store=rendezvous(rd, env, cfg.trainer.timeout_s),
        rank=env.rank,
        world_size=env.world,
        timeout=datetime.timedelta(seconds=cfg.trainer.timeout_s),
    )
    try:
        summary = run_learner(cfg, rd)
    finally:
        dist.destroy_process_group()
        if lock is not None:
            lock.release()
    if env.rank == 0:
        log.info("summary %s", summary)
    return 3 if summary.get("preempted") else 0


def supervise(role: str, run_dir: str, index: int | None = None, max_restarts: int = 5) -> int:
    """``agent-r1 role ROLE --supervise``: the role as a child process, restarted in place when it
    dies (back-off 1, 2, 4 … 30 s; at most ``max_restarts`` times) until the run ends. Under Slurm
    this keeps a rollout server, worker or router alive without the job step ending; a replaced
    server publishes its new address and the coordinator brings it to the current weights."""
    import signal

    from agent_r1.logging import setup_logging
    from agent_r1.process import die_with_parent
    from agent_r1.train.config import from_yaml

    rd = RunDir.at(run_dir)
    spec = role_spec(from_yaml(rd.config), role)
    name = f"{role}_{detect().rank if index is None else index}"
    setup_logging(f"{name} supervisor")
    stop = {"sig": None}
    child: list[subprocess.Popen] = []

    def forward(signum, frame) -> None:  # noqa: ARG001
        stop["sig"] = signum
        if child and child[0].poll() is None:
            child[0].send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    restarts = 0
    while True:
        child[:] = [subprocess.Popen(role_command(role, rd.root, index), preexec_fn=die_with_parent())]
        rc = child[0].wait()
        if rc == 0 or stop["sig"] is not None or rd.shutdown_flag.exists() or rd.stopping:
            return 0 if stop["sig"] is not None or rd.shutdown_flag.exists() else rc
        restarts += 1
        if restarts > max_restarts:
            log.error("%s died %d times (last exit %s): giving up", name, restarts, rc)
            return rc
        published = spec.published(rd, name)
        if published is not None:  # its address is dead; the replacement publishes anew
            published.unlink(missing_ok=True)
        delay = min(2 ** (restarts - 1), 30)
        log.warning(
            "%s exited with %s; restarting it in %d s (%d/%d)", name, rc, delay, restarts, max_restarts
        )
        time.sleep(delay)


def quiet_progress_bars_in_batch_logs() -> None:
    """A batch log (stderr not a terminal) gets no HF progress-bar redraws (model loading, saving)."""
    if not sys.stderr.isatty():
        import transformers.utils.logging as hf_logging

        hf_logging.disable_progress_bar()


def role_command(role: str, run_dir: Path, index: int | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "agent_r1.cli", "role", role, "--run-dir", str(run_dir)]
    return cmd + (["--index", str(index)] if index is not None else [])
