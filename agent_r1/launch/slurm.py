"""Slurm launch: the resolved config -> one heterogeneous sbatch job (or one job array for a sweep).

Component 0 holds the learner ranks (one task per GPU), component 1 the rollout servers (SGLang on
GPU nodes, the embedded engine on CPU nodes) and the rollout workers. Every role is an
``srun`` step running ``agent-r1 role ...``; they find each other through the run directory on
the shared filesystem. ``cluster.colocated`` puts everything in one component.
"""

from __future__ import annotations

import json
import shlex
import string
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent_r1.engine_spec import ENGINES, engine_spec
from agent_r1.errors import AgentR1Error
from agent_r1.launch.roles import run_roles
from agent_r1.train.config import ConfigError, TrainConfig, load_config
from agent_r1.train.run_dir import RunDir, RunLock

SLURM_DIR = Path(__file__).resolve().parents[2] / "slurm"


class SlurmError(AgentR1Error, RuntimeError):
    pass


@dataclass
class Layout:
    learner_nodes: int
    learner_tasks_per_node: int
    rollout_nodes: int
    servers: int
    workers: int
    colocated: bool

    def describe(self) -> str:
        if self.colocated:
            return (
                f"one component: {self.learner_nodes} node(s), {self.learner_tasks_per_node} learner task(s) "
                f"per node, {self.servers} server(s), {self.workers} worker(s)"
            )
        return (
            f"het job: component 0 = {self.learner_nodes} learner node(s) x {self.learner_tasks_per_node} "
            f"task(s); component 1 = {self.rollout_nodes} rollout node(s) with {self.servers} server(s) and "
            f"{self.workers} worker(s)"
        )


def layout(cfg: TrainConfig) -> Layout:
    c, p, r = cfg.cluster, cfg.parallel, cfg.rollout
    if p.learner_ranks % c.learner_nodes:
        raise ConfigError(
            f"config parallel.learner_ranks={p.learner_ranks} must split evenly over cluster.learner_nodes={c.learner_nodes}"
        )
    per_node = p.learner_ranks // c.learner_nodes
    if c.gpus_per_node and per_node != c.gpus_per_node:
        raise ConfigError(
            f"config parallel.learner_ranks: {per_node} learner ranks per node but cluster.gpus_per_node="
            f"{c.gpus_per_node} (one rank per GPU)"
        )
    if not c.colocated:
        if c.rollout_nodes < 1:
            raise ConfigError("config cluster.rollout_nodes must be >= 1 (or cluster.colocated=true)")
        if (
            engine_spec(r.engine).serving == "child_process"
            and c.gpus_per_node
            and r.servers % c.rollout_nodes
        ):
            raise ConfigError(
                f"config rollout.servers={r.servers} must split evenly over cluster.rollout_nodes={c.rollout_nodes}"
            )
    if engine_spec(r.engine).serving == "none":
        served = [n for n, e in ENGINES.items() if e.serving != "none"]
        raise ConfigError(
            f"config rollout.engine={r.engine}: the servers are not part of the job; use {', '.join(served)}"
        )
    return Layout(c.learner_nodes, per_node, c.rollout_nodes, r.servers, r.workers, c.colocated)


def _sbatch_lines(cfg: TrainConfig, lay: Layout, log_dir: Path) -> list[str]:
    c = cfg.cluster
    common = [f"--job-name=agent-r1-{cfg.trainer.name}", f"--time={c.time}"]
    for key in ("partition", "account", "qos"):
        if getattr(c, key):
            common.append(f"--{key}={getattr(c, key)}")
    head = [
        *common,
        f"--output={log_dir}/slurm-%j.out",
        "--open-mode=append",
    ]
    if c.requeue:
        head += ["--requeue", f"--signal=B:USR1@{c.signal_seconds}"]
    head += list(c.extra_sbatch)

    def component(nodes: int, tasks_per_node: int, gpus: int) -> list[str]:
        out = [
            f"--nodes={nodes}",
            f"--ntasks-per-node={tasks_per_node}",
            f"--cpus-per-task={c.cpus_per_task}",
        ]
        if gpus:
            out.append(f"--gpus-per-node={gpus}")
        if c.mem is not None:
            out.append(f"--mem={c.mem}")
        return out

    gpus = c.gpus_per_node
    learner = component(lay.learner_nodes, lay.learner_tasks_per_node, gpus)
    lines = [f"#SBATCH {x}" for x in head + learner]
    if not lay.colocated:
        rollout_tasks = -(-(lay.servers + lay.workers) // lay.rollout_nodes)
        lines.append("#SBATCH hetjob")
        lines += [f"#SBATCH {x}" for x in component(lay.rollout_nodes, rollout_tasks, gpus)]
    return lines


def _wrap(cfg: TrainConfig, cmd: list[str]) -> str:
    """The command as run inside the container (apptainer) or plain."""
    c = cfg.cluster
    if c.apptainer_image:
        cmd = ["apptainer", "exec", *(["--nv"] if c.gpus_per_node else []), c.apptainer_image, *cmd]
    return " ".join(shlex.quote(x) for x in cmd)


def _srun(
    cfg: TrainConfig, group: int | None, ntasks: int, nodes: int, cmd: list[str], extra: list[str] = ()
) -> str:
    c = cfg.cluster
    opts = ["srun", "--kill-on-bad-exit=1", f"--ntasks={ntasks}", f"--nodes={nodes}", "--overlap"]
    if group is not None:
        opts.insert(1, f"--het-group={group}")
    opts += list(extra)
    if c.container_image:
        opts.append(f"--container-image={c.container_image}")
        if c.container_mounts:
            opts.append(f"--container-mounts={','.join(c.container_mounts)}")
    return " ".join(opts) + " " + _wrap(cfg, cmd)


def python_cmd(cfg: TrainConfig) -> list[str]:
    return [cfg.cluster.python or sys.executable, "-m", "agent_r1.cli"]


def render_job(
    cfg: TrainConfig, rd: RunDir, workdir: str | Path | None = None, in_array: bool = False
) -> str:
    """The sbatch script of a run: heterogeneous (learner component, rollout component) unless
    ``cluster.colocated``. ``in_array``: the body of one task of a job array instead, whose
    allocation is one block of learner + rollout nodes (Slurm has no arrays of het jobs): each
    role's ``srun`` is placed with ``--relative`` (learners on the first nodes, rollout roles on
    the rest), and there are no ``#SBATCH`` lines (the array script holds them)."""
    lay = layout(cfg)
    c = cfg.cluster
    py = python_cmd(cfg)
    run = str(rd.root)
    roll_nodes = lay.learner_nodes if lay.colocated else lay.rollout_nodes
    if in_array:  # one allocation: place by node offset
        roll_group = learn_group = None
        roll_place = [] if lay.colocated else [f"--relative={lay.learner_nodes}"]
        learn_place = ["--relative=0"]
    else:
        roll_group = None if lay.colocated else 1
        learn_group = None if lay.colocated else 0
        roll_place = learn_place = []
    gpu_opt = ["--gpus-per-task=1"] if c.gpus_per_node else []
    # rollout roles are supervised in their step: one that dies is restarted in place
    steps = []
    for spec in run_roles(cfg):
        if spec.learner:
            continue
        n = spec.count(cfg)
        opts = [f"--gpus-per-task={spec.gpus(cfg)}"] if c.gpus_per_node and spec.gpus(cfg) else []
        idx = ["--index", "0"] if spec.single else []
        cmd = [*py, "role", spec.name, "--run-dir", run, *idx, "--supervise"]
        steps.append(_srun(cfg, roll_group, n, min(roll_nodes, n), cmd, [*roll_place, *opts]) + " &")
    learner = _srun(
        cfg,
        learn_group,
        cfg.parallel.learner_ranks,
        lay.learner_nodes,
        [*py, "role", "learner", "--run-dir", run],
        [*learn_place, *gpu_opt],
    )
    env = []
    if c.network_interface:
        env.append(
            f"export NCCL_SOCKET_IFNAME={c.network_interface} GLOO_SOCKET_IFNAME={c.network_interface}"
        )
    tmpl = string.Template((SLURM_DIR / "train.sbatch.tmpl").read_text())
    return tmpl.substitute(
        name=cfg.trainer.name,
        layout=lay.describe(),
        sbatch="# (one task of a job array: the array script holds the #SBATCH lines)"
        if in_array
        else "\n".join(_sbatch_lines(cfg, lay, rd.logs)),
        setup="\n".join(c.setup),
        run_dir=shlex.quote(run),
        threads=str(max(1, c.cpus_per_task)),
        env="\n".join(env),
        workdir=shlex.quote(str(workdir or Path.cwd())),
        srun_rollout="\n".join(steps),
        srun_learner=learner,
    )


def sbatch(script: Path) -> str:
    try:
        out = subprocess.run(
            ["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=120
        )
    except FileNotFoundError:
        raise SlurmError(
            "sbatch not found: is this a Slurm login node? (tools/local_slurm.sh starts a local cluster)"
        ) from None
    if out.returncode != 0:
        raise SlurmError(f"sbatch {script} failed: {out.stderr.strip()}")
    return out.stdout.strip().split(";")[0]


def launch(overrides: list[str], dry_run: bool = False, plan: bool = True) -> dict[str, Any]:
    """``agent-r1 launch``: validate, prepare the run directory, render, plan (a GPU cluster's
    learner and rollout memory, ``agent-r1 plan``; refused when it does not fit), submit."""
    from agent_r1.launch.launcher import default_run_dir, prepare_run

    cfg = load_config(overrides)
    if cfg.cluster.launcher != "slurm":
        raise ConfigError(
            "config cluster.launcher must be slurm for `agent-r1 launch` (e.g. cluster=slurm_gpu)"
        )
    rd = RunDir.at(default_run_dir(cfg))
    script = render_job(cfg, rd)
    if dry_run:
        return {"script": script, "run_dir": str(rd.root)}
    planned = None
    if plan and cfg.cluster.gpus_per_node > 0:
        from agent_r1.launch.plan import PlanError
        from agent_r1.launch.plan import plan as dry_run_plan

        planned = dry_run_plan(list(overrides))
        if not planned.fits:
            raise PlanError(
                f"the plan says this run does not fit (skip it with --no-plan):\n{planned.table()}"
            )
    rd.create()
    if planned is not None:
        (rd.root / "plan.txt").write_text(planned.table() + "\n")
    RunLock(rd).acquire("agent-r1 launch").release()  # refuses while a job of this run is training
    prepare_run(cfg, local=False)  # the compute nodes, not this login node, have the GPUs
    rd.new_api_key()  # the job's servers require it; its workers and learners read it
    path = rd.root / "job.sbatch"
    path.write_text(script)
    job = sbatch(path)
    (rd.control / "slurm_job_id").write_text(job)
    return {
        "job_id": job,
        "run_dir": str(rd.root),
        "script": str(path),
        "logs": [str(rd.logs / f"slurm-{job}.out"), str(rd.logs / "learner_0.log")],
        "tensorboard": f"tensorboard --logdir {rd.tensorboard}",
    }


# ---- sweeps -------------------------------------------------------------------------------------
def sweep_tasks(spec: dict[str, Any]) -> list[list[str]]:
    """Override lists of a sweep: the ``grid`` (cartesian product) or the explicit ``list``."""
    import itertools

    if ("grid" in spec) == ("list" in spec):
        raise ConfigError(
            "sweep config: give exactly one of `grid` (key: [values]) or `list` ([[overrides]])"
        )
    if "list" in spec:
        return [list(x) for x in spec["list"]]
    keys = list(spec["grid"])
    values = [spec["grid"][k] for k in keys]
    return [[f"{k}={v}" for k, v in zip(keys, combo, strict=True)] for combo in itertools.product(*values)]


def render_array(spec: dict[str, Any], sweep_dir: Path, n: int, cfg: TrainConfig) -> str:
    """The job array of a sweep. A local-launcher preset: every task is one node running
    ``agent-r1 sweep-task`` (all roles as local processes). A Slurm preset (a GPU layout): every
    task is one allocation of learner + rollout nodes running its own rendered job body
    (``task_NNN/job.sh``, roles placed with ``srun --relative``)."""
    c = cfg.cluster
    k = int(spec.get("max_parallel", n))
    lines = [
        f"--job-name=agent-r1-sweep-{spec['name']}",
        f"--time={c.time}",
        f"--array=0-{n - 1}%{k}",
        f"--output={sweep_dir}/logs/task_%a.out",
    ]
    if c.launcher == "slurm":
        lay = layout(cfg)
        nodes = lay.learner_nodes + (0 if lay.colocated else lay.rollout_nodes)
        rollout_per_node = 0 if lay.colocated else -(-(lay.servers + lay.workers) // lay.rollout_nodes)
        lines += [
            f"--nodes={nodes}",
            f"--ntasks-per-node={max(lay.learner_tasks_per_node, rollout_per_node)}",
            f"--cpus-per-task={c.cpus_per_task}",
        ]
    else:
        lines += ["--nodes=1", "--ntasks=1", f"--cpus-per-task={c.cpus_per_task}"]
    for key in ("partition", "account", "qos"):
        if getattr(c, key):
            lines.append(f"--{key}={getattr(c, key)}")
    if c.gpus_per_node:
        lines.append(f"--gpus-per-node={c.gpus_per_node}")
    if c.mem is not None:
        lines.append(f"--mem={c.mem}")
    body = "\n".join(c.setup)
    if c.launcher == "slurm":
        run = f'bash "{sweep_dir}/task_$(printf %03d "$SLURM_ARRAY_TASK_ID")/job.sh"\n'
    else:
        cmd = _wrap(cfg, [*python_cmd(cfg), "sweep-task", str(sweep_dir / "sweep.json")])
        run = f'{cmd} "$SLURM_ARRAY_TASK_ID"\n'
    return (
        "#!/bin/bash\n"
        f"# Agent-R1 sweep {spec['name']}: {n} tasks, at most {k} at once. Rendered by `agent-r1 sweep`.\n"
        + "\n".join(f"#SBATCH {x}" for x in lines)
        + f"\n\nset -uo pipefail\n{body}\nexport PYTHONUNBUFFERED=1\ncd {shlex.quote(str(Path.cwd()))}\n"
        + run
    )


def _override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def merge_overrides(base: list[str], extra: list[str]) -> list[str]:
    """The sweep's ``base`` overrides with the command line's on top: one that sets a key ``base``
    sets replaces it (``+experiment=X`` swaps the preset; Hydra refuses two values for one key), in
    ``base``'s form (``experiment=X`` for a base ``+experiment=...`` is still an addition)."""
    given = {_override_key(o): o for o in extra}
    out = []
    for o in base:
        key = _override_key(o)
        if key in given:
            new = given.pop(key)
            prefix = o[: len(o) - len(o.lstrip("+~"))]
            out.append(prefix + new.lstrip("+~"))
        else:
            out.append(o)
    return out + [o for o in extra if _override_key(o) in given]


def sweep(
    path: str | Path, extra: list[str], dry_run: bool = False, out_dir: str | None = None
) -> dict[str, Any]:
    """``agent-r1 sweep``: every task's config validated, then one job array."""
    from omegaconf import OmegaConf

    spec = OmegaConf.to_container(OmegaConf.load(str(path)), resolve=True)
    if "name" not in spec:
        raise ConfigError(f"sweep config {path}: needs a `name`")
    unknown = set(spec) - {"name", "base", "grid", "list", "max_parallel"}
    if unknown:
        raise ConfigError(f"sweep config {path}: unknown keys {sorted(unknown)}")
    sweep_dir = Path(out_dir or Path("runs") / "sweeps" / spec["name"]).resolve()
    base = merge_overrides(spec.get("base", []), extra)
    tasks = []
    for i, over in enumerate(sweep_tasks(spec)):
        args = [
            *base,
            *over,
            f"trainer.run_dir={sweep_dir / f'task_{i:03d}'}",
            f"trainer.name={spec['name']}_{i:03d}",
        ]
        try:
            cfg = load_config(args)
        except ConfigError as e:
            raise ConfigError(f"sweep task {i} ({' '.join(over)}): {e}") from None
        tasks.append({"index": i, "overrides": over, "args": args})
        if cfg.cluster.launcher == "slurm":  # its own multi-node job body
            tasks[-1]["job"] = render_job(cfg, RunDir.at(sweep_dir / f"task_{i:03d}"), in_array=True)
            tasks[-1]["cfg"] = cfg
    script = render_array(spec, sweep_dir, len(tasks), cfg)
    if dry_run:
        return {
            "script": script,
            "tasks": [{k: v for k, v in t.items() if k != "cfg"} for t in tasks],
            "sweep_dir": str(sweep_dir),
        }
    from agent_r1.launch.launcher import prepare_run

    for t in tasks:
        if "job" in t:  # prepared like `agent-r1 launch` prepares a run
            rd = RunDir.at(sweep_dir / f"task_{t['index']:03d}").create()
            RunLock(rd).acquire("agent-r1 sweep").release()
            prepare_run(t.pop("cfg"), local=False)
            rd.new_api_key()
            (rd.root / "job.sh").write_text(t.pop("job"))
    (sweep_dir / "logs").mkdir(parents=True, exist_ok=True)
    (sweep_dir / "sweep.json").write_text(json.dumps({"name": spec["name"], "tasks": tasks}, indent=1))
    (sweep_dir / "array.sbatch").write_text(script)
    job = sbatch(sweep_dir / "array.sbatch")
    return {
        "job_id": job,
        "sweep_dir": str(sweep_dir),
        "tasks": len(tasks),
        "tensorboard": f"tensorboard --logdir {sweep_dir}",
        "report": f"python tools/sweep_report.py {sweep_dir}",
    }


def sweep_task(sweep_json: str | Path, index: int) -> int:
    """One array task: its overrides, its own run directory, all roles on its node."""
    from agent_r1.launch.launcher import train_local

    spec = json.loads(Path(sweep_json).read_text())
    args = spec["tasks"][index]["args"]
    cfg = load_config([*args, "cluster.launcher=local", "parallel.backend=gloo"])
    return train_local(cfg)
