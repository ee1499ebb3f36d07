"""``agent-r1 records audit RUN``: did the run train every committed step exactly once?

Read from the run directory alone (what a chaos run, a crash or a requeue leaves behind):

* the **ledger** (one line per update the final weights contain; a resume cuts it to the checkpoint
  it starts from): every iteration from 0 to the last exactly once, and the policy version after
  each update one more than after the one before (a version that jumps means an update the ledger
  does not show, one that repeats an update shown twice);
* each ledger entry against the **records**: the shards it names are the iteration's committed
  shards, their files still hash to the checksums it saw, every group whole (``prompts x
  group_size`` trajectories: nothing dropped), and no step older than the staleness bound when it
  was trained (``rollout.max_staleness``; 0 in sync mode);
* the newest **checkpoint** against the ledger: it holds the last ledger iteration and version, and
  its optimizer step count is the warm start's plus one per mini-batch of every ledger iteration (an
  update trained twice into the weights, or lost from them, shows here).

``lost_steps`` counts step records committed to an iteration but not in its update (or of an
iteration the ledger skips); ``double_trained`` counts repeated updates (ledger lines, version
repeats, optimizer steps beyond the ledger's).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from agent_r1.records.shard import file_checksum, iteration_dir
from agent_r1.train.run_dir import RunDir


def _ledger(rd: RunDir) -> tuple[list[dict[str, Any]], int]:
    entries, torn = [], 0
    if rd.ledger.exists():
        for line in rd.ledger.read_text().splitlines():
            if not line.strip():
                continue
            try:
                entries.append(json.loads(line))
            except ValueError:
                torn += 1
    return entries, torn


def _newest_checkpoint(rd: RunDir) -> dict[str, Any] | None:
    from agent_r1.train.replay import _checkpoints

    kept = _checkpoints(rd)
    if not kept:
        return None
    path = kept[max(kept)]
    return {**json.loads((path / "agent_r1_state.json").read_text()), "path": str(path)}


def _records_of(rd: RunDir, entry: dict[str, Any]) -> tuple[list[str], int, list[int]]:
    """(problems with the entry's shards, committed rows not in it, the policy versions of its rows)."""
    import pyarrow.ipc as ipc

    it = entry["iteration"]
    d = iteration_dir(rd.records, it)
    problems, versions = [], []
    metas = [json.loads(p.read_text()) for p in d.glob("shard_*.meta.json")]
    for name, checksum in entry["shards"].items():
        path = d / name
        if not path.exists():
            problems.append(f"iteration {it}: {name} is gone")
            continue
        if file_checksum(path)[0] != checksum:
            problems.append(f"iteration {it}: {name} no longer matches the checksum its update saw")
            continue
        versions += ipc.open_file(str(path)).read_all().column("policy_version").to_pylist()
    extra = sum(m["rows"] for m in metas if m["name"] not in entry["shards"])
    return problems, extra, versions


def audit(run_dir: str | Path) -> dict[str, Any]:
    """The run's invariant, checked; ``ok`` when nothing is lost, repeated or out of bounds."""
    from agent_r1.train.config import from_yaml

    rd = RunDir.at(run_dir)
    cfg = from_yaml(rd.config)
    rc, alg = cfg.rollout, cfg.algorithm
    eta = 0 if rc.mode == "sync" else rc.max_staleness
    per_iteration = rc.prompts_per_iteration * rc.group_size
    entries, torn = _ledger(rd)
    problems: list[str] = [f"{torn} torn ledger line(s)"] if torn else []
    lost = double = 0
    seen: dict[int, int] = {}
    for k, e in enumerate(entries):
        it = e["iteration"]
        if it in seen:
            double += e["rows"]
            problems.append(f"iteration {it} is in the ledger twice (lines {seen[it] + 1} and {k + 1})")
            continue
        seen[it] = k
        if k and e["version"] != entries[k - 1]["version"] + 1:
            prev = entries[k - 1]["version"]
            double += 1
            problems.append(
                f"iteration {it}: policy version {e['version']} after {prev} (an update not in the ledger)"
            )
        bad, extra, versions = _records_of(rd, e)
        problems += bad
        lost += extra
        if extra:
            problems.append(f"iteration {it}: {extra} committed step(s) not in its update")
        if e["trajectories"] != per_iteration:
            problems.append(
                f"iteration {it}: {e['trajectories']} trajectories trained, {per_iteration} issued"
            )
        trained_by = e["version"] - 1
        if versions and min(versions) < trained_by - eta:
            problems.append(
                f"iteration {it}: a step of policy version {min(versions)} trained by version {trained_by} "
                f"(bound {eta})"
            )
    last = max(seen, default=-1)
    for it in sorted(set(range(last + 1)) - set(seen)):
        d = iteration_dir(rd.records, it)
        rows = sum(json.loads(p.read_text())["rows"] for p in d.glob("shard_*.meta.json"))
        lost += rows or per_iteration
        problems.append(f"iteration {it} is missing from the ledger")
    ckpt = _newest_checkpoint(rd)
    if entries and ckpt is None:
        problems.append("no complete checkpoint")
    elif ckpt is not None and entries:
        t = ckpt["trainer"]
        tail = entries[-1]
        if (t["iteration"], t["version"]) != (tail["iteration"], tail["version"]):
            problems.append(
                f"the newest checkpoint ({ckpt['path']}) holds iteration {t['iteration']} version "
                f"{t['version']}, the ledger ends at {tail['iteration']} version {tail['version']}"
            )
        sft = cfg.sft.steps if t.get("sft_done") else 0
        expected = sft + len(seen) * alg.epochs * alg.mini_batches
        if ckpt["steps"] != expected:
            double += max(0, ckpt["steps"] - expected)
            lost += per_iteration * (expected > ckpt["steps"])
            problems.append(
                f"the newest checkpoint took {ckpt['steps']} optimizer steps; the warm start and the "
                f"ledger's {len(seen)} updates account for {expected}"
            )
    return {
        "ok": not problems,
        "iterations": len(seen),
        "lost_steps": lost,
        "double_trained": double,
        "staleness_bound": eta,
        "checkpoint": None if ckpt is None else ckpt["path"],
        "problems": problems,
    }
