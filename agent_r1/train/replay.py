"""``agent-r1 records replay RUN --until N``: did the learner do what the records say?

From the run's checkpoint after iteration K (the newest kept one before N, or ``--from K``), the
learner is built from the run's own config and re-trains iterations K+1 .. N on the committed
shards the ledger says each update consumed (their checksums checked against it), at the policy
versions the ledger records; its weights are then compared with the run's checkpoint after N,
tensor by tensor (HF names): how many are bitwise equal, the largest difference. A learner whose
reductions split the same way (the same threads, the same layout) gives bitwise-equal weights; a
difference beyond float noise says an update trained on something its records do not hold.

One process (gloo, world 1) replays a run of one learner rank; a run of several is replayed under
``torchrun --nproc-per-node <learner ranks>`` with the same layout.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
from pathlib import Path
from typing import Any

from agent_r1.errors import AgentR1Error
from agent_r1.records.reader import RecordStore
from agent_r1.train.run_dir import RunDir

log = logging.getLogger("agent_r1.replay")


class ReplayError(AgentR1Error):
    """The run cannot be replayed as asked (the message says what is missing)."""


def _ledger(rd: RunDir) -> dict[int, dict[str, Any]]:
    if not rd.ledger.exists():
        raise ReplayError(f"{rd.ledger}: no ledger (the run trained no iteration)")
    entries = [json.loads(x) for x in rd.ledger.read_text().splitlines() if x.strip()]
    return {e["iteration"]: e for e in entries}


def _checkpoints(rd: RunDir) -> dict[int, Path]:
    """The complete checkpoints by the iteration their state says they hold."""
    out = {}
    for p in sorted(rd.checkpoints.glob("iter_*")):
        state = p / "agent_r1_state.json"  # not iter_N.tmp (a save cut off) nor iter_N.corrupt
        if p.name[5:].isdigit() and p.is_dir() and state.exists():
            out[int(json.loads(state.read_text())["trainer"]["iteration"])] = p
    return out


def plan_replay(rd: RunDir, until: int, start: int | None) -> tuple[Path, Path, list[dict[str, Any]]]:
    """(the checkpoint to start from, the one to compare with, the ledger entries to replay)."""
    ckpts, ledger = _checkpoints(rd), _ledger(rd)
    if until not in ckpts:
        raise ReplayError(
            f"no checkpoint after iteration {until} in {rd.checkpoints} (kept: {sorted(ckpts)}; "
            "trainer.checkpoint_every and trainer.keep_checkpoints decide which stay)"
        )
    before = sorted(k for k in ckpts if k < until)
    if start is None:
        if not before:
            raise ReplayError(f"no checkpoint before iteration {until} to start from (kept: {sorted(ckpts)})")
        start = before[-1]
    if start not in ckpts or start >= until:
        raise ReplayError(f"--from {start}: not a kept checkpoint before {until} (kept: {sorted(ckpts)})")
    missing = [i for i in range(start + 1, until + 1) if i not in ledger]
    if missing:
        raise ReplayError(f"the ledger has no update of iteration(s) {missing}")
    return ckpts[start], ckpts[until], [ledger[i] for i in range(start + 1, until + 1)]


def _check_shards(rd: RunDir, entry: dict[str, Any]) -> None:
    manifest = RecordStore(rd.records).manifest(entry["iteration"])
    got = {k: v["checksum"] for k, v in sorted(manifest["shards"].items())}
    if got != entry["shards"]:
        raise ReplayError(
            f"iteration {entry['iteration']}: the committed shards {sorted(got)} are not the ones the "
            f"ledger says its update consumed {sorted(entry['shards'])} (or their checksums differ)"
        )


def compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Tensor-by-tensor comparison of two HF state dicts."""
    names = sorted(set(a) | set(b))
    only = [n for n in names if n not in a or n not in b]
    both = [n for n in names if n in a and n in b]
    equal = [
        n
        for n in both
        if a[n].dtype == b[n].dtype and a[n].shape == b[n].shape and bool((a[n] == b[n]).all())
    ]
    diffs = {n: float((a[n].double() - b[n].double()).abs().max()) for n in both if n not in equal}
    worst = max(diffs, key=diffs.get) if diffs else None
    return {
        "tensors": len(both),
        "bitwise_equal": len(equal),
        "max_abs_diff": diffs[worst] if worst else 0.0,
        "worst_tensor": worst,
        "missing": only,
    }


def _init_distributed(world: int) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=30))
    elif world == 1:  # one process: an in-memory store, no port
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    else:
        raise ReplayError(
            f"the run has {world} learner ranks: replay it under torchrun --nproc-per-node {world}"
        )
    if dist.get_world_size() != world:
        raise ReplayError(f"{dist.get_world_size()} processes, but the run has {world} learner ranks")


def replay(run_dir: str | Path, until: int, start: int | None = None) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from agent_r1.cpus import usable_cpus
    from agent_r1.learner.backend.cpu_compat import apply
    from agent_r1.train.config import from_yaml
    from agent_r1.train.learner_rank import Learner

    rd = RunDir.at(run_dir)
    if not rd.config.exists():
        raise ReplayError(f"{run_dir}: not a run directory (no config.yaml)")
    cfg = from_yaml(rd.config)
    first, last, entries = plan_replay(rd, until, start)
    for e in entries:
        _check_shards(rd, e)
    torch.set_num_threads(usable_cpus())
    _init_distributed(cfg.parallel.learner_ranks)
    if cfg.parallel.backend == "gloo":
        apply()
    cfg.parallel.initialize()
    try:
        learner = Learner(cfg)
        state = learner.load(first)
        if learner.reward_scaler is not None and state.get("reward_scaling"):
            learner.reward_scaler.load_state_dict(state["reward_scaling"])
        log.info("replaying iterations %d..%d from %s", entries[0]["iteration"], until, first)
        for e in entries:  # the version the update trained at: one before the ledger's (after it)
            learner.update(learner.read(rd.records, e["iteration"]), e["version"] - 1, e["iteration"])
        replayed = learner.gather_hf_weights()
        learner.load(last)
        recorded = learner.gather_hf_weights()
        out = None
        if dist.get_rank() == 0:
            out = {"run": str(rd.root), "from": str(first), "until": str(last),
                   "iterations": [e["iteration"] for e in entries], **compare(replayed, recorded)}  # fmt: skip
        return out
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()
