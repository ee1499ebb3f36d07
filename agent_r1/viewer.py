"""``agent-r1 view RUN_DIR``: one self-contained HTML file to browse a run's trajectories.

No server and nothing fetched: the data (decoded with the run's tokenizer) and the page's script
and style are inlined. Iterations -> groups (a group's trajectories side by side) -> trajectories
-> steps; a step shows its observation (the tokens new since the previous step highlighted, the
shared prefix folded), its action with per-token logprob shading, tool calls and feedback, step
and process rewards, the advantage, the policy version. Filters: success, reward range, tool
errors, truncation. The run's curves from its TensorBoard scalars. Large runs stay usable: at most
``groups_per_iteration`` groups per iteration (chosen evenly, seeded), texts capped per field, steps
rendered only when opened; the header states what was sampled and the file's size.

Advantages: the records' ``advantage`` column when present, else recomputed with the run's
estimator when it needs no critic (grpo, rloo, reinforce_pp, gigpo, ...), else left out.
"""

from __future__ import annotations

import html
import json
import logging
import math
import random
from pathlib import Path
from typing import Any

from agent_r1.errors import AgentR1Error

log = logging.getLogger("agent_r1.view")
ASSETS = Path(__file__).resolve().parent / "viewer_assets"
MAX_CHARS = 4000  # per text field; the rest is cut with a note
CURVE_TAGS = ("eval/success", "rollout/success", "rollout/reward", "eval/reward")


def _cut(text: str, limit: int = MAX_CHARS) -> str:
    return text if len(text) <= limit else text[:limit] + f"\n[... {len(text) - limit} more characters]"


def _advantages(table: Any, cfg: Any) -> list[float | None]:
    if "advantage" in table.column_names:
        return table.column("advantage").to_pylist()
    from agent_r1.algos.advantages import ADVANTAGES

    name = cfg.algorithm.advantage
    est = ADVANTAGES.get(name)
    if est.level != "step" or set(est.needs) - {"anchor"}:
        return [None] * table.num_rows  # needs the critic's values or the teacher: not in records
    import numpy as np
    import pyarrow as pa
    import torch

    from agent_r1.algos.advantages import compute_advantages
    from agent_r1.algos.reduce import LocalReducer
    from agent_r1.learner.step_inputs import to_step_inputs

    t = table.append_column("_row", pa.array(np.arange(table.num_rows)))
    batch = to_step_inputs(t, cfg.algorithm.process_coef, anchors="anchor" in est.needs)
    with torch.no_grad():
        adv = compute_advantages(name, batch.inputs, cfg.algorithm.estimator, LocalReducer())
    out: list[float | None] = [None] * table.num_rows
    rows = batch.table.column("_row").to_pylist()
    for r, a in zip(rows, adv.step_adv.tolist(), strict=True):
        out[r] = float(a)
    return out


def _step(row: dict[str, Any], adv: float | None, codec: Any) -> dict[str, Any]:
    obs, p = row["obs_token_ids"], row["prefix_len"]
    info = json.loads(row["info"]) if isinstance(row["info"], str) else (row["info"] or {})
    tokens = [
        [codec.decode([t]), round(lp, 4)]
        for t, lp in zip(row["action_token_ids"], row["action_logprobs"], strict=True)
    ]
    if len(tokens) > MAX_CHARS // 4:
        tokens = tokens[: MAX_CHARS // 4] + [[f"[... {len(tokens) - MAX_CHARS // 4} more tokens]", 0.0]]
    return {
        "i": row["step_index"],
        "prefix": _cut(codec.decode(obs[:p])[-300:], 300) if p else "",
        "prefix_len": p,
        "obs_len": len(obs),
        "new": _cut(codec.decode(obs[p:])),
        "action": tokens,
        "calls": [
            {k: c.get(k) for k in ("name", "error") if c.get(k) is not None}
            for c in info.get("tool_calls", [])
        ],
        "feedback": _cut(row["feedback"] or ""),
        "reward": row["reward"],
        "process": row["process_reward"],
        "adv": None if adv is None or not math.isfinite(adv) else round(adv, 4),
        "version": row["policy_version"],
        "finish": row["finish_reason"],
        "truncated": row["truncated"],
        "errors": int(info.get("num_tool_errors", 0)),
        "correct": (info.get("reward") or {}).get("correct")
        if isinstance(info.get("reward"), dict)
        else None,
    }


def collect(run: Path, groups_per_iteration: int = 8, seed: int = 0, strict: bool = False) -> dict[str, Any]:
    """Everything the page shows, as plain JSON; a damaged iteration is marked (``strict``: an error)."""
    from agent_r1.agent.chat import ChatCodec
    from agent_r1.records.reader import RecordStore
    from agent_r1.train.config import from_yaml
    from agent_r1.train.plot import read_scalars

    if not (run / "config.yaml").exists():
        raise AgentR1Error(f"{run}: not a run directory (no config.yaml)")
    cfg = from_yaml(run / "config.yaml")
    codec = ChatCodec.load(cfg.model.path)
    rng = random.Random(seed)
    trajs: list[dict[str, Any]] = []
    iterations: list[dict[str, Any]] = []
    total = 0
    for kind, folder in (("train", run / "records"), ("eval", run / "eval_records")):
        if not folder.exists():
            continue
        for it, table, damaged in RecordStore(folder).readable(strict):
            if damaged is not None:  # named on the page and in the log; the rest is shown
                log.warning("skipping damaged %s iteration %d: %s", kind, it, damaged)
                iterations.append(
                    {"kind": kind, "it": it, "groups": [], "total": 0, "total_groups": 0, "damaged": damaged}
                )
                continue
            advs = _advantages(table, cfg) if kind == "train" else [None] * table.num_rows
            rows = table.drop_columns(
                [
                    c
                    for c in table.column_names
                    if c.startswith("token_") or c in ("ref_logprobs", "teacher_logprobs")
                ]
            ).to_pylist()
            by_traj: dict[str, list[tuple[dict[str, Any], float | None]]] = {}
            for r, a in zip(rows, advs, strict=True):
                by_traj.setdefault(r["trajectory_id"], []).append((r, a))
            groups: dict[str, list[str]] = {}
            for tid, steps in by_traj.items():
                groups.setdefault(steps[0][0]["group_id"], []).append(tid)
            total += len(by_traj)
            keep = sorted(groups)
            if len(keep) > groups_per_iteration:
                keep = sorted(rng.sample(keep, groups_per_iteration))
            shown_groups = []
            for g in keep:
                idx = []
                for tid in groups[g]:
                    steps = sorted(by_traj[tid], key=lambda x: x[0]["step_index"])
                    s = [_step(r, a, codec) for r, a in steps]
                    last = s[-1]
                    trajs.append(
                        {
                            "id": tid, "group": g, "kind": kind, "it": it, "steps": s,
                            "reward": round(sum(x["reward"] or 0.0 for x in s), 4),
                            "success": bool(last["correct"]) if last["correct"] is not None else None,
                            "errors": sum(x["errors"] for x in s),
                            "truncated": bool(last["truncated"]),
                            "calls": sum(len(x["calls"]) for x in s),
                        }
                    )  # fmt: skip
                    idx.append(len(trajs) - 1)
                shown_groups.append({"id": g, "trajs": idx})
            iterations.append(
                {
                    "kind": kind,
                    "it": it,
                    "groups": shown_groups,
                    "total": len(by_traj),
                    "total_groups": len(groups),
                }
            )
    scalars = read_scalars(run / "tensorboard") if (run / "tensorboard").exists() else {}
    curves = {t: scalars[t] for t in CURVE_TAGS if scalars.get(t)}
    curves.update({t: v for t, v in scalars.items() if t.startswith("eval/") and t not in curves and v})
    return {
        "run": run.name,
        "path": str(run),
        "algorithm": cfg.algorithm.name,
        "recipe": cfg.recipe.name,
        "model": cfg.model.path,
        "total_trajectories": total,
        "shown_trajectories": len(trajs),
        "groups_per_iteration": groups_per_iteration,
        "iterations": iterations,
        "trajs": trajs,
        "curves": curves,
    }


def render(data: dict[str, Any]) -> str:
    page = (ASSETS / "viewer.html").read_text()
    payload = json.dumps(data, ensure_ascii=False, separators=(",", ":")).replace("</", "<\\/")
    return (
        page.replace("/*STYLE*/", (ASSETS / "viewer.css").read_text())
        .replace("/*SCRIPT*/", (ASSETS / "viewer.js").read_text())
        .replace("__TITLE__", html.escape(f"agent-r1 view: {data['run']}"))
        .replace("__DATA__", payload)
    )


def write_view(
    run: str | Path, out: str | Path | None = None, groups_per_iteration: int = 8, strict: bool = False
) -> tuple[Path, dict[str, Any]]:
    run = Path(run).resolve()
    data = collect(run, groups_per_iteration, strict=strict)
    out = Path(out) if out else run / "view.html"
    text = render(data)
    # the page states its own size: render once, measure, then write the number in
    size = len(text.encode())
    data["file_bytes"] = size
    text = render(data)
    data["file_bytes"] = len(text.encode())
    text = render(data)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    return out, data
