"""``agent-r1 records synth|stats|show|advantages|replay|audit`` -- record shards from the command line.

``advantages`` runs in one process or under ``mpirun``/``srun --mpi=pmix`` (mpi4py): each rank
takes whole shards round-robin, group statistics are reduced across ranks, and every rank writes
its shards; the output does not depend on the number of ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from agent_r1 import cli_args
from agent_r1.errors import AgentR1Error
from agent_r1.logging import setup_logging


def _mpi_comm():
    if any(k in os.environ for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "PMI_RANK")):
        from mpi4py import MPI

        return MPI.COMM_WORLD
    return None


def cmd_synth(a: argparse.Namespace) -> int:
    from agent_r1.records.shard import finalize_iteration, write_shard
    from agent_r1.records.synth import synth_table

    log = setup_logging("records")
    t = synth_table(a.trajectories, a.group_size, a.max_steps, seed=a.seed, id_prefix=f"it{a.iteration}")
    # trajectory i -> writer i % writers: the samples of one group land in different shards, as
    # when a group's samples run on different rollout workers
    traj = (
        pc.dictionary_encode(t.column("trajectory_id"))
        .combine_chunks()
        .indices.to_numpy(zero_copy_only=False)
    )
    for w in range(min(a.writers, a.trajectories)):
        part = t.filter(pa.array(traj % a.writers == w))
        m = write_shard(a.out, a.iteration, w, part, a.compression)
        log.info(
            "shard %s: %d steps, %d trajectories, %.2f MB", m.name, m.rows, m.num_trajectories, m.bytes / 1e6
        )
    man = finalize_iteration(a.out, a.iteration)
    log.info(
        "iteration %d: %d steps in %d shards under %s", a.iteration, man["rows"], len(man["shards"]), a.out
    )
    return 0


def _stats(t: pa.Table) -> dict[str, float]:
    n = t.num_rows
    if n == 0:
        return {"steps": 0}
    steps_per = pc.value_counts(t.column("trajectory_id")).field("counts").to_numpy()
    obs = pc.list_value_length(t.column("obs_token_ids")).to_numpy(zero_copy_only=False)
    act = pc.list_value_length(t.column("action_token_ids")).to_numpy(zero_copy_only=False)
    prefix = t.column("prefix_len").to_numpy()
    done = t.column("done").to_numpy(zero_copy_only=False)
    reward = t.column("reward").to_numpy(zero_copy_only=False)
    calls = pc.list_value_length(t.column("process_reward")).to_numpy(zero_copy_only=False)
    unique = (obs - prefix).sum() + act.sum()
    return {
        "steps": n,
        "trajectories": len(steps_per),
        "groups": len(pc.unique(t.column("group_id"))),
        "steps_per_trajectory_mean": float(steps_per.mean()),
        "steps_per_trajectory_max": int(steps_per.max()),
        "obs_tokens_mean": float(obs.mean()),
        "action_tokens_mean": float(act.mean()),
        "tool_calls_per_step": float(calls.mean()),
        "terminal_reward_mean": float(np.nanmean(reward[done])) if done.any() else 0.0,
        "truncated_fraction": float(t.column("truncated").to_numpy(zero_copy_only=False)[done].mean())
        if done.any()
        else 0.0,
        # tokens a prefix-merged forward computes / tokens T re-prefills would compute
        "prefix_merge_ratio": float(unique / (obs.sum() + act.sum())),
        "policy_version_min": int(pc.min(t.column("policy_version")).as_py()),
        "policy_version_max": int(pc.max(t.column("policy_version")).as_py()),
    }


def cmd_stats(a: argparse.Namespace) -> int:
    from agent_r1.records.reader import RecordStore

    out = {}
    for it, table, damaged in RecordStore(a.dir).readable(a.strict):
        out[f"iter_{it:06d}"] = _stats(table) if damaged is None else {"damaged": _skipping(it, damaged)}
    print(json.dumps(out, indent=1))
    return 0


def _skipping(iteration: int, why: str) -> str:
    """Say on stderr (stdout is the command's output) that a damaged iteration is skipped."""
    print(f"warning: skipping damaged iteration {iteration}: {why}", file=sys.stderr, flush=True)
    return why


def cmd_show(a: argparse.Namespace) -> int:
    from agent_r1.records.reader import RecordStore
    from agent_r1.records.schema import records_from_table, table_images

    store = RecordStore(a.dir)
    if a.iteration is not None:
        it, t = a.iteration, store.read(a.iteration)  # the one asked for: damaged is an error
    else:  # the newest intact one
        it = t = None
        for i, table, damaged in store.readable(a.strict, newest_first=True):
            if damaged is None:
                it, t = i, table
                break
            _skipping(i, damaged)
        if t is None:
            raise AgentR1Error(f"no readable finalized iteration under {store.dir}")
    tid = a.trajectory or t.column("trajectory_id")[0].as_py()
    t = t.filter(pc.equal(t.column("trajectory_id"), tid))
    if t.num_rows == 0:
        raise AgentR1Error(f"trajectory {tid!r} not found in iteration {it}")
    tok = None
    if a.tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(a.tokenizer)
    recs = sorted(records_from_table(t), key=lambda r: r.step_index)
    try:
        stored = {h: buf.size for (_, h), buf in table_images(t).items()}
    except ValueError as e:
        raise AgentR1Error(f"iteration {it}: {e}") from None
    extra = {n: t.column(n).to_pylist() for n in ("advantage", "return", "value") if n in t.column_names}
    print(f"trajectory {tid}  group {recs[0].group_id}  iteration {it}  steps {len(recs)}")
    for i, r in enumerate(recs):
        head = (
            f"--- step {r.step_index}  policy v{r.policy_version}  obs {len(r.obs_token_ids)} tok "
            f"(prefix {r.prefix_len})  action {len(r.action_token_ids)} tok ({r.num_trainable_tokens} trained)  "
            f"reward {r.reward}  process {r.process_reward}  done {r.done}  truncated {r.truncated}  finish {r.finish_reason}"
        )
        print(head + "".join(f"  {k} {v[i]:.4f}" for k, v in extra.items() if v[i] is not None))
        if tok is not None:
            print("[new observation]\n" + tok.decode(r.obs_token_ids[r.prefix_len :]))
            print("[action]\n" + tok.decode(r.action_token_ids))
        if r.images:
            print(
                f"[images] {len(r.images)}: "
                + ", ".join(_image_line(h, stored[h], h in r.image_data) for h in r.images)
            )
        if r.feedback:
            print("[feedback]\n" + r.feedback)
        if r.info:
            print("[info] " + json.dumps(r.info, ensure_ascii=False))
    return 0


def _image_line(h: str, size: int, new: bool) -> str:
    return f"{h[:12]} ({size / 1024:.1f} KiB{', stored here' if new else ''})"


def cmd_advantages(a: argparse.Namespace) -> int:
    import torch

    from agent_r1.algos.advantages import ADVANTAGES, AdvantageConfig, compute_advantages
    from agent_r1.algos.reduce import LocalReducer, MPIReducer
    from agent_r1.learner.step_inputs import to_step_inputs, with_advantages
    from agent_r1.records.reader import RecordStore
    from agent_r1.records.shard import finalize_iteration, write_shard

    comm = _mpi_comm()
    rank, world = (comm.Get_rank(), comm.Get_size()) if comm is not None else (0, 1)
    log = setup_logging(f"advantages r{rank}/{world}")
    est = ADVANTAGES.get(a.estimator)
    cfg = AdvantageConfig(
        gamma=a.gamma,
        lam=a.lam,
        norm_by_std=not a.no_std,
        whiten=not a.no_whiten,
        gigpo_step_weight=a.gigpo_step_weight,
        equal_trajectory_weight=a.equal_trajectory_weight,
    )
    reducer = MPIReducer(comm) if world > 1 else LocalReducer()
    store = RecordStore(a.dir)
    for it in store.iterations():
        shards = store.shards(it)
        mine = [m for i, m in enumerate(shards) if i % world == rank]
        tables = [store.read_shard(it, m) for m in mine]
        source = (
            np.concatenate([np.full(t.num_rows, i) for i, t in enumerate(tables)])
            if tables
            else np.zeros(0, int)
        )
        table = (
            pa.concat_tables(tables, promote_options="default")
            if tables
            else store.read_shard(it, shards[0]).slice(0, 0)
        )
        batch = to_step_inputs(
            table, a.process_coef, tokens=est.level == "token", anchors="anchor" in est.needs
        )
        with torch.no_grad():
            adv = compute_advantages(a.estimator, batch.inputs, cfg, reducer)
        out = with_advantages(batch, adv)
        src = source[batch.order]
        for i, m in enumerate(mine):
            part = out.filter(pa.array(src == i))
            write_shard(a.out, it, m.name[len("shard_") : -len(".arrow")], part, m.compression)
        log.info("iteration %d: %s on %d steps in %d shards", it, a.estimator, out.num_rows, len(mine))
        if comm is not None:
            comm.Barrier()
        if rank == 0:
            finalize_iteration(a.out, it, expected_writers=len(shards))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    from agent_r1.algos.advantages import ADVANTAGES
    from agent_r1.records.shard import COMPRESSIONS

    p = sub.add_parser("records", help="step-record shards: synth, stats, show, advantages, replay, audit")
    rs = p.add_subparsers(dest="records_command", required=True)

    s = rs.add_parser("synth", help="write synthetic but realistic step records")
    s.add_argument("--trajectories", type=cli_args.positive_int, required=True)
    s.add_argument("--group-size", type=cli_args.positive_int, default=4)
    s.add_argument("--max-steps", type=cli_args.positive_int, default=6)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument(
        "--writers", type=cli_args.positive_int, default=2, help="number of shards (one per writer)"
    )
    s.add_argument("--iteration", type=cli_args.nonneg_int, default=0)
    s.add_argument(
        "--compression",
        default="none",
        choices=COMPRESSIONS,
        help="none: zero-copy mmap reads, fastest (default); lz4/zstd: smaller files",
    )
    s.add_argument("--out", required=True, help="records directory (e.g. run_dir/records)")
    s.set_defaults(fn=cmd_synth)

    st = rs.add_parser("stats", help="per-iteration statistics as JSON")
    st.add_argument("dir")
    st.add_argument(
        "--strict", action="store_true", help="a damaged iteration is an error (default: skipped)"
    )
    st.set_defaults(fn=cmd_stats)

    sh = rs.add_parser("show", help="a readable dump of one trajectory, step by step")
    sh.add_argument("dir")
    sh.add_argument("--trajectory", help="trajectory id (default: the first)")
    sh.add_argument("--iteration", type=cli_args.nonneg_int, help="default: the newest")
    sh.add_argument("--tokenizer", help="HF tokenizer folder to decode observations and actions")
    sh.add_argument(
        "--strict", action="store_true", help="a damaged iteration is an error (default: skipped)"
    )
    sh.set_defaults(fn=cmd_show)

    ad = rs.add_parser("advantages", help="write records with advantages (single process or under mpirun)")
    ad.add_argument("dir")
    ad.add_argument("--estimator", required=True, choices=ADVANTAGES.names())
    ad.add_argument("--gamma", type=cli_args.unit_interval, default=1.0)
    ad.add_argument("--lam", type=cli_args.unit_interval, default=1.0)
    ad.add_argument("--no-std", action="store_true", help="GRPO without std normalisation (Dr.GRPO)")
    ad.add_argument("--no-whiten", action="store_true", help="GAE/REINFORCE++ without batch whitening")
    ad.add_argument("--gigpo-step-weight", type=cli_args.finite_float, default=1.0)
    ad.add_argument("--equal-trajectory-weight", action="store_true")
    ad.add_argument(
        "--process-coef", type=cli_args.finite_float, default=1.0, help="weight of tool-call process rewards"
    )
    ad.add_argument("--out", required=True)
    ad.set_defaults(fn=cmd_advantages)

    rp = rs.add_parser(
        "replay",
        help="re-train a run's iterations from its shards and ledger and compare the weights with its "
        "checkpoint (did the learner do what the records say?)",
    )
    rp.add_argument("run_dir")
    rp.add_argument("--until", type=cli_args.nonneg_int, required=True, help="the iteration to reach")
    rp.add_argument(
        "--from", dest="start", type=cli_args.nonneg_int, default=None,
        help="the checkpointed iteration to start from (default: the newest kept one before --until)",
    )  # fmt: skip
    rp.set_defaults(fn=cmd_replay)

    au = rs.add_parser(
        "audit",
        help="check from a run directory alone that every committed step was trained exactly once (the "
        "ledger, the records, the newest checkpoint)",
    )
    au.add_argument("run_dir")
    au.set_defaults(fn=cmd_audit)


def cmd_audit(a: argparse.Namespace) -> int:
    """Exit 0 when nothing is lost, repeated or out of the staleness bound, 1 otherwise."""
    from agent_r1.train.audit import audit

    out = audit(a.run_dir)
    print(json.dumps(out, indent=1))
    print(
        f"AUDIT iterations={out['iterations']} lost_steps={out['lost_steps']} "
        f"double_trained={out['double_trained']} problems={len(out['problems'])}",
        flush=True,
    )
    return 0 if out["ok"] else 1


def cmd_replay(a: argparse.Namespace) -> int:
    """Exit 0 when every tensor is bitwise equal to the run's checkpoint, 1 otherwise."""
    from agent_r1.train.replay import replay

    setup_logging("replay")
    out = replay(a.run_dir, a.until, a.start)
    if out is None:  # not rank 0 under torchrun
        return 0
    print(json.dumps(out, indent=1))
    verdict = (
        "bitwise equal"
        if out["bitwise_equal"] == out["tensors"] and not out["missing"]
        else f"differ: max |delta| {out['max_abs_diff']:.3g} in {out['worst_tensor']}"
    )
    print(
        f"replayed iterations {out['iterations'][0]}..{out['iterations'][-1]}: {out['bitwise_equal']} of "
        f"{out['tensors']} tensors bitwise equal to {out['until']} ({verdict})",
        flush=True,
    )
    return 0 if verdict == "bitwise equal" else 1


__all__ = ["add_parser"]
