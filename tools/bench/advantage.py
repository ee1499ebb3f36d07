#!/usr/bin/env python
"""Benchmark: advantages over ~2M synthetic step records vs a pandas groupby implementation of the
same estimator, and shard write+read throughput vs raw ``dd`` of the same number of bytes.

    python tools/bench/advantage.py [--trajectories 570000] [--shard-trajectories 40000] [--dir /tmp/agent_r1_bench]

Both advantage paths start from the same Arrow table and include their own column extraction; the
results are compared (max |diff| printed) so the speed-up is for the same numbers. Ends with
``BENCH <name> <metric>=<value> baseline=<name> ratio=<x>`` lines.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import torch

from agent_r1.algos.advantages import AdvantageConfig, compute_advantages
from agent_r1.learner.step_inputs import to_step_inputs
from agent_r1.records.reader import RecordStore
from agent_r1.records.shard import finalize_iteration, write_shard
from agent_r1.records.synth import synth_table


def best_of(fn, repeat: int):
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), out


# ---- ours ----------------------------------------------------------------------------------------
def ours(table: pa.Table, estimator: str, cfg: AdvantageConfig) -> pd.Series:
    b = to_step_inputs(table)
    with torch.no_grad():
        a = compute_advantages(estimator, b.inputs, cfg)
    return a.step_adv.numpy()[np.argsort(b.order)]  # back to table row order


# ---- pandas baseline -----------------------------------------------------------------------------
def _frame(table: pa.Table) -> pd.DataFrame:
    df = table.select(
        ["trajectory_id", "group_id", "step_index", "reward", "value", "process_reward"]
    ).to_pandas()
    proc = df.process_reward.explode().astype(float).fillna(0.0).groupby(level=0).sum()
    df["r"] = df.reward.fillna(0.0) + proc.reindex(df.index, fill_value=0.0)
    return df.drop(columns=["process_reward"])


def pandas_grpo(table: pa.Table, cfg: AdvantageConfig) -> np.ndarray:
    df = _frame(table)
    traj = df.groupby("trajectory_id", sort=False).agg(R=("r", "sum"), group=("group_id", "first"))
    g = traj.groupby("group").R
    mean, std, cnt = g.transform("mean"), g.transform("std").fillna(0.0), g.transform("count")
    a = (traj.R - mean) / (std + cfg.eps)
    a[(cnt <= 1) | (std <= 1e-9 * (1 + mean.abs()))] = 0.0
    return df.trajectory_id.map(a).to_numpy()


def pandas_gae(table: pa.Table, cfg: AdvantageConfig, max_steps: int) -> np.ndarray:
    df = _frame(table).sort_values(["trajectory_id", "step_index"])
    g = df.groupby("trajectory_id", sort=False)
    v_next = g.value.shift(-1).fillna(0.0)
    delta = df.r + cfg.gamma * v_next - df.value
    adv = delta.copy()
    for _ in range(max_steps - 1):  # A_t = delta_t + gamma lam A_{t+1}, converged after max_steps passes
        adv = delta + cfg.gamma * cfg.lam * adv.groupby(df.trajectory_id, sort=False).shift(-1).fillna(0.0)
    a = (adv - adv.mean()) / np.sqrt(adv.var(ddof=1) + 1e-8)
    return a.sort_index().to_numpy()


# ---- shard I/O ------------------------------------------------------------------------------------
def shard_io(table: pa.Table, d: Path, writers: int, compression: str) -> tuple[float, int]:
    shutil.rmtree(d, ignore_errors=True)
    n = table.num_rows
    t0 = time.perf_counter()
    total = 0
    for w in range(writers):
        a, b = w * n // writers, (w + 1) * n // writers
        total += write_shard(d, 0, w, table.slice(a, b - a), compression).bytes
    finalize_iteration(d, 0, expected_writers=writers)
    got = RecordStore(d).read(0)
    assert got.num_rows == n
    return time.perf_counter() - t0, total


def dd_io(nbytes: int, d: Path) -> float:
    d.mkdir(parents=True, exist_ok=True)
    f = d / "dd.bin"
    mb = max(1, nbytes // (1 << 20))
    t0 = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={f}", "bs=1M", f"count={mb}", "conv=fsync"],
        check=True,
        capture_output=True,
    )
    subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=1M"], check=True, capture_output=True)
    dt = time.perf_counter() - t0
    f.unlink()
    return dt * nbytes / (mb << 20)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trajectories", type=int, default=570_000, help="~3.5 steps each: ~2M step records")
    ap.add_argument("--shard-trajectories", type=int, default=40_000)
    ap.add_argument("--writers", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/agent_r1_bench")
    a = ap.parse_args()
    torch.set_num_threads(1)
    lines = []

    t0 = time.perf_counter()
    table = synth_table(
        a.trajectories,
        group_size=8,
        max_steps=6,
        seed=0,
        prompt_len=(4, 8),
        action_len=(2, 4),
        feedback_len=(1, 2),
    )
    print(
        f"synthesised {table.num_rows:,} step records ({a.trajectories:,} trajectories) in {time.perf_counter() - t0:.1f} s"
    )
    cfg = AdvantageConfig(gamma=0.99, lam=0.95)
    for name, ref in (("grpo", lambda: pandas_grpo(table, cfg)), ("gae", lambda: pandas_gae(table, cfg, 6))):
        t_ours, got = best_of(lambda n=name: ours(table, n, cfg), a.repeat)
        t_pd, want = best_of(ref, max(1, a.repeat - 1))
        diff = float(np.abs(got - want).max())
        print(f"{name}: ours {t_ours:.2f} s, pandas {t_pd:.2f} s, max |diff| {diff:.2e}")
        assert diff < 1e-6, f"{name}: results differ from the pandas reference by {diff}"
        rate = table.num_rows / t_ours
        lines.append(
            f"BENCH advantage_{name}_{round(table.num_rows / 1e6)}M steps_per_s={rate:.0f} baseline=pandas_groupby ratio={t_pd / t_ours:.1f}"
        )

    shard_table = synth_table(a.shard_trajectories, group_size=8, max_steps=6, seed=1)
    d = Path(a.dir)
    for compression in ("none", "lz4", "zstd"):
        t_io, nbytes = min(
            (
                shard_io(shard_table, d / f"shards_{compression}", a.writers, compression)
                for _ in range(a.repeat)
            ),
            key=lambda x: x[0],
        )
        t_dd = min(dd_io(nbytes, d) for _ in range(a.repeat))
        mbps = nbytes / t_io / 1e6
        print(
            f"shards[{compression}]: {nbytes / 1e6:.0f} MB written+read in {t_io:.3f} s ({mbps:.0f} MB/s); dd same bytes {t_dd:.3f} s ({nbytes / t_dd / 1e6:.0f} MB/s)"
        )
        lines.append(
            f"BENCH shard_write_read_{compression} MB_per_s={mbps:.0f} baseline=dd ratio={t_dd / t_io:.2f}"
        )
    shutil.rmtree(d, ignore_errors=True)
    print("\n".join(lines))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
