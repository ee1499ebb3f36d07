"""What the coordinator reports: TensorBoard scalars and texts, one console line per iteration."""

from __future__ import annotations

import logging
import math
from typing import Any

log = logging.getLogger("agent_r1.metrics")


def _success(t: Any) -> float:
    if "success" in t.metrics:
        return float(t.metrics["success"])
    last = t.steps[-1].info.get("reward", {}) if t.steps else {}
    return float(bool(last.get("correct")))


def episode_stats(trajs: list[Any]) -> dict[str, float]:
    """Sums over trajectories (the coordinator divides): episodes, successes, reward, steps, tools."""
    steps = [s for t in trajs for s in t.steps]
    return {
        "episodes": float(len(trajs)),
        "success": sum(_success(t) for t in trajs),
        "reward": sum(t.total_reward for t in trajs),
        "steps": float(len(steps)),
        "tool_calls": float(sum(t.num_tool_calls for t in trajs)),
        "tool_errors": float(sum(s.info.get("num_tool_errors", 0) for s in steps)),
        "action_tokens": float(sum(len(s.action_token_ids) for s in steps)),
        "truncated": float(sum(1 for t in trajs if t.steps and t.steps[-1].truncated)),
        **_task_sums(t.steps[-1].info for t in trajs if t.steps),
    }


def _task_sums(terminal_infos: Any) -> dict[str, float]:
    """Sums of the task metrics a reward reports besides success (``info.reward.metrics``, e.g.
    F1 or recall), as ``task/<name>``."""
    out: dict[str, float] = {}
    for info in terminal_infos:
        for k, v in (info.get("reward") or {}).get("metrics", {}).items():
            out[f"task/{k}"] = out.get(f"task/{k}", 0.0) + float(v)
    return out


STATS_COLUMNS = ["trajectory_id", "reward", "process_reward", "done", "truncated", "info", "action_token_ids"]


def table_stats(table: Any) -> dict[str, float]:
    """``episode_stats`` of committed records (also for records a previous run generated), from the
    columns alone: no token list is turned into Python objects. Needs ``STATS_COLUMNS``."""
    import json

    import pyarrow.compute as pc

    done = table.column("done").to_numpy(zero_copy_only=False).astype(bool)
    info = table.column("info").to_pylist()
    terminal = [json.loads(info[i]) for i in done.nonzero()[0]]
    errors = sum(json.loads(x).get("num_tool_errors", 0) for x in info if "num_tool_errors" in x)

    def total(col) -> float:
        return float(pc.sum(col).as_py() or 0.0)

    return {
        "episodes": float(len(pc.unique(table.column("trajectory_id")))),
        "success": float(sum(bool(t.get("reward", {}).get("correct")) for t in terminal)),
        "reward": total(table.column("reward")),
        "steps": float(table.num_rows),
        "tool_calls": total(pc.list_value_length(table.column("process_reward"))),
        "tool_errors": float(errors),
        "action_tokens": total(pc.list_value_length(table.column("action_token_ids"))),
        "truncated": float((done & table.column("truncated").to_numpy(zero_copy_only=False)).sum()),
        **_task_sums(terminal),
    }


def rollout_scalars(pooled: dict[str, Any], prefix: str = "rollout") -> dict[str, float]:
    """Per-trajectory means from the workers' summed episode statistics."""
    n = max(pooled.get("episodes", 0.0), 1.0)
    steps = max(pooled.get("steps", 0.0), 1.0)
    out = {
        f"{prefix}/success": pooled.get("success", 0.0) / n,
        f"{prefix}/reward": pooled.get("reward", 0.0) / n,
        f"{prefix}/steps_per_trajectory": pooled.get("steps", 0.0) / n,
        f"{prefix}/tool_calls_per_trajectory": pooled.get("tool_calls", 0.0) / n,
        f"{prefix}/tool_errors_per_trajectory": pooled.get("tool_errors", 0.0) / n,
        f"{prefix}/response_tokens_per_step": pooled.get("action_tokens", 0.0) / steps,
        f"{prefix}/truncated_fraction": pooled.get("truncated", 0.0) / n,
    }
    for k, v in pooled.items():
        if k.startswith("task/"):
            out[f"{prefix}/{k[5:]}"] = v / n
    return out


class Reporter:
    """TensorBoard writer of the coordinator (``None`` writer on other ranks: nothing is written)."""

    def __init__(self, logdir: str | None, purge_step: int | None = None):
        self.writer = None
        if logdir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(logdir, purge_step=purge_step)

    def scalars(self, values: dict[str, float], step: int) -> None:
        if self.writer is None:
            return
        for k, v in sorted(values.items()):
            if isinstance(v, (int, float)) and math.isfinite(float(v)):
                self.writer.add_scalar(k, float(v), step)
        self.writer.flush()

    def histogram(self, tag: str, values: Any, step: int) -> None:
        if self.writer is not None and len(values):
            self.writer.add_histogram(tag, values, step)

    def text(self, tag: str, text: str, step: int) -> None:
        if self.writer is not None:
            self.writer.add_text(tag, text, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def console_line(iteration: int, total: int, m: dict[str, float]) -> str:
    def g(k: str, fmt: str = "{:.3f}") -> str:
        return fmt.format(m[k]) if k in m else "-"

    return (
        f"iter {iteration + 1}/{total} | success {g('rollout/success')} reward {g('rollout/reward')} "
        f"| steps {g('rollout/steps_per_trajectory', '{:.2f}')} tools {g('rollout/tool_calls_per_trajectory', '{:.2f}')} "
        f"| loss {g('loss/pg', '{:+.4f}')} kl {g('approx_kl', '{:.4f}')} ent {g('entropy')} "
        f"gnorm {g('grad_norm', '{:.2f}')} | eval {g('eval/success')} "
        f"| gen {g('time/generate', '{:.1f}')}s train {g('time/train', '{:.1f}')}s "
        f"sync {g('time/weight_sync', '{:.2f}')}s"
        + (f" | stale max {m['staleness/max']:.0f}" if m.get("staleness/max") else "")
    )


def sample_text(codec: Any, table: Any, k: int) -> list[str]:
    """The first ``k`` trajectories of a record table as readable text (last observation + actions)."""
    import pyarrow.compute as pc

    if k <= 0 or table.num_rows == 0:
        return []
    ids = pc.unique(table.column("trajectory_id")).to_pylist()[:k]
    out = []
    for tid in ids:
        t = table.filter(pc.equal(table.column("trajectory_id"), tid)).to_pylist()
        t.sort(key=lambda r: r["step_index"])
        last = t[-1]
        text = codec.decode(last["obs_token_ids"] + last["action_token_ids"])
        out.append(f"**{tid}** reward={last['reward']}\n\n```\n{text[-3000:]}\n```")
    return out
