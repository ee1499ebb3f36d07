"""``agent-r1 eval``: a model (an HF folder, a run directory's checkpoint, or a server / router URL)
on a recipe's split or a file of data rows, ``n`` samples per prompt.

Writes ``metrics.json`` (success and mean reward with 95% intervals — Wilson's and a bootstrap
over prompts — unbiased pass@k for k <= n, steps, tool calls and errors, truncation, tokens, wall
time, each prompt's success) and the episodes as a step-record shard. ``--baseline`` compares with
an earlier evaluation of the same rows: the gain and its paired bootstrap interval. With ``--run`` and no other settings it evaluates exactly as the trainer does (its test
split, greedy, its step and token budgets, its engine settings), so the number it prints is the
trainer's held-out number for that checkpoint.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("agent_r1.eval")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``c`` correct among ``n`` samples: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def wilson(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a success rate (sound at 0 and 1, unlike mean +- 1.96 sd)."""
    if n == 0:
        return 0.0, 0.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def mean_ci(xs: list[float], z: float = 1.96) -> tuple[float, float, float]:
    """Mean and its normal-approximation 95% interval."""
    if not xs:
        return 0.0, 0.0, 0.0
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, m, m
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))
    half = z * sd / math.sqrt(len(xs))
    return m, m - half, m + half


BOOTSTRAP_SAMPLES = 10_000


def bootstrap_ci(values: list[float], samples: int = BOOTSTRAP_SAMPLES, seed: int = 0) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the mean of ``values`` (resampled with replacement,
    seeded: the same values give the same interval). Paired differences give a gain's interval."""
    import numpy as np

    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return 0.0, 0.0
    idx = np.random.default_rng(seed).integers(0, x.size, size=(samples, x.size))
    means = x[idx].mean(axis=1)
    return float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))


def paired_gain(metrics: dict[str, Any], baseline: dict[str, Any], where: str) -> dict[str, Any]:
    """``metrics`` minus ``baseline`` (two evaluations of the same rows): the success gain, its
    paired bootstrap interval over prompts, and what the baseline was."""
    from agent_r1.errors import UsageError

    a, b = metrics["per_prompt_success"], baseline.get("per_prompt_success")
    if b is None:
        raise UsageError(f"--baseline {where}: no per_prompt_success (evaluate the baseline again)")
    mine = (metrics["data"], metrics["settings"]["num"], len(a))
    theirs = (baseline.get("data"), baseline.get("settings", {}).get("num"), len(b))
    if mine != theirs:
        raise UsageError(f"--baseline {where}: evaluated other rows (data, num, prompts: {theirs} vs {mine})")
    diff = [x - y for x, y in zip(a, b, strict=True)]
    lo, hi = bootstrap_ci(diff)
    return {
        "baseline": {"model": baseline.get("model"), "success": baseline.get("success"), "path": where},
        "gain": sum(diff) / len(diff),
        "gain_ci95": [lo, hi],
    }


def summarize(trajs: list[Any], n: int, wall_s: float) -> dict[str, Any]:
    """Metrics of ``trajs`` (``n`` consecutive samples per prompt, as ``run_episodes`` orders them)."""
    success = [float(t.metrics.get("success", 0.0)) for t in trajs]
    reward = [float(t.metrics.get("reward", 0.0)) for t in trajs]
    lo, hi = wilson(sum(success), len(success))
    r_mean, r_lo, r_hi = mean_ci(reward)
    prompts = [success[i : i + n] for i in range(0, len(success), n)]
    per_prompt = [sum(p) / len(p) for p in prompts]
    steps = [len(t.steps) for t in trajs]
    out: dict[str, Any] = {
        "episodes": len(trajs),
        "prompts": len(prompts),
        "samples_per_prompt": n,
        "success": sum(success) / max(len(success), 1),
        "success_ci95": [lo, hi],
        "success_bootstrap_ci95": list(bootstrap_ci(per_prompt)),
        "reward": r_mean,
        "reward_ci95": [r_lo, r_hi],
        "pass_at_k": {
            str(k): sum(pass_at_k(n, int(sum(p)), k) for p in prompts) / max(len(prompts), 1)
            for k in range(1, n + 1)
        },
        "steps_per_episode": sum(steps) / max(len(steps), 1),
        "tool_calls_per_episode": sum(t.num_tool_calls for t in trajs) / max(len(trajs), 1),
        "tool_errors_per_episode": sum(s.info.get("num_tool_errors", 0) for t in trajs for s in t.steps)
        / max(len(trajs), 1),
        "truncated_fraction": sum(bool(t.steps and t.steps[-1].truncated) for t in trajs)
        / max(len(trajs), 1),
        "action_tokens": sum(len(s.action_token_ids) for t in trajs for s in t.steps),
        "wall_seconds": round(wall_s, 2),
        "per_prompt_success": per_prompt,
    }
    return out


def default_out(a: Any, checkpoint: str) -> Path:
    """Where an evaluation goes without ``--out``: inside the run, one folder per checkpoint (the one
    ``resolve_model`` picked), split and sampling (``RUN/evals/valid_unseen-iter_000015-n8-T1-s7``), so
    evaluations never overwrite each other; without a run, ``./eval_out``."""
    if not a.run:
        return Path("eval_out")
    name = f"{a.split or 'test'}-{Path(checkpoint).name}"
    name += f"-n{a.n}" if a.n > 1 else ""
    name += f"-T{a.temperature:g}" if a.temperature is not None else ""
    name += f"-s{a.seed}" if a.seed is not None else ""
    return Path(a.run) / "evals" / name


def add_parser(sub: Any) -> None:
    from agent_r1 import cli_args
    from agent_r1.commands.flags import add_episode_flags, add_policy_flags
    from recipes import RECIPES

    ev = sub.add_parser("eval", help="evaluate a model, a run's checkpoint or a server on a held-out split")
    add_policy_flags(ev)
    ev.add_argument(
        "--recipe", default=None, choices=RECIPES, help="default: the run's, else arithmetic_tool"
    )
    ev.add_argument("--split", default=None, help="default test")
    ev.add_argument("--data", help="a parquet file of data rows instead of a recipe")
    ev.add_argument(
        "--num",
        type=cli_args.positive_int,
        default=None,
        help="prompts (default: the run's test_size, else 64)",
    )
    ev.add_argument(
        "--n", type=cli_args.positive_int, default=1, help="samples per prompt (pass@k for k <= n)"
    )
    add_episode_flags(ev)
    ev.add_argument(
        "--out",
        default=None,
        help="metrics.json and the episodes' records go here (default: RUN/evals/SPLIT-CHECKPOINT[-nN][-TT][-sS]"
        " with --run, else ./eval_out)",
    )
    ev.add_argument(
        "--baseline",
        default=None,
        help="an earlier evaluation of the same rows (its metrics.json or folder): the success gain"
        " over it with a paired bootstrap 95%% interval",
    )
    ev.add_argument(
        "--index", default=None, help="the search tools' index (default: the run's retrieval.index)"
    )
    ev.add_argument("--no-progress", action="store_true")
    ev.set_defaults(fn=run)


def run(a: Any) -> int:
    from agent_r1.logging import setup_logging

    setup_logging("eval")
    m = run_eval(a)
    lo, hi = m["success_ci95"]
    passes = " ".join(f"pass@{k} {v:.3f}" for k, v in m["pass_at_k"].items())
    gain = ""
    if "gain" in m:
        g_lo, g_hi = m["gain_ci95"]
        gain = f"\ngain over {m['baseline']['model']}: {m['gain']:+.3f} [{g_lo:+.3f}, {g_hi:+.3f}] (paired bootstrap)"
    print(
        f"eval {m['data']}: success {m['success']:.3f} [{lo:.3f}, {hi:.3f}] over {m['episodes']} episodes"
        f" ({m['prompts']} prompts x {m['samples_per_prompt']}); {passes}; reward {m['reward']:.3f};"
        f" steps {m['steps_per_episode']:.2f} tools {m['tool_calls_per_episode']:.2f}{gain}\n"
        f"metrics:  {m['out']}/metrics.json\nepisodes: {m['out']}/records",
        flush=True,
    )
    return 0


def run_eval(a: Any) -> dict[str, Any]:
    """The ``agent-r1 eval`` command: returns the metrics it wrote to ``OUT/metrics.json``."""
    from agent_r1.agent.flow import AGENTS
    from agent_r1.commands.policy_source import resolve_policy, serving
    from agent_r1.data.rows import load_rows
    from agent_r1.errors import UsageError
    from agent_r1.records.schema import records_to_table
    from agent_r1.records.shard import finalize_iteration, write_shard
    from recipes import load_all, load_recipe

    load_all()
    baseline = None
    if a.baseline:  # read first: a wrong path fails before anything starts
        where = Path(a.baseline)
        where = where / "metrics.json" if where.is_dir() else where
        try:
            baseline = json.loads(where.read_text())
        except (OSError, ValueError) as e:
            raise UsageError(f"--baseline {a.baseline}: not an evaluation's metrics.json ({e})") from None
    # a run's evaluations without --out share one export of each checkpoint (RUN/evals/hf_iter_N)
    exports = Path(a.out or (Path(a.run) / "evals" if a.run else "eval_out"))
    exports.mkdir(parents=True, exist_ok=True)
    policy = resolve_policy(a, exports)  # resolved first: nothing starts for a bad path
    cfg, source = policy.cfg, policy.source
    out = Path(a.out) if a.out else default_out(a, source)
    out.mkdir(parents=True, exist_ok=True)
    recipe = a.recipe or (cfg.recipe.name if cfg is not None else "arithmetic_tool")
    split = a.split or "test"
    num = a.num or (cfg.recipe.test_size if cfg is not None else 64)
    if a.data:
        rows = load_rows(a.data, AGENTS)[:num]
    elif cfg is not None and a.recipe is None and a.split is None:
        from agent_r1.train.splits import split_rows

        rows = split_rows(cfg, "test", num)  # exactly the trainer's held-out rows
    else:
        r = cfg.recipe if cfg is not None else None
        opts = dict(r.options) if r is not None and r.name == recipe else {}
        rows = load_recipe(recipe).build_rows(split=split, num=num, seed=r.seed if r else 0, **opts)
    concurrency = cfg.rollout.max_concurrency if cfg is not None else 64
    t0 = time.time()
    with serving(policy, a):
        trajs = policy.run_episodes(
            rows, a.n, id_prefix="eval", max_concurrency=concurrency, progress=not a.no_progress
        )
    metrics = summarize(trajs, a.n, time.time() - t0)
    settings = {"recipe": recipe, "split": split, "num": num, "seed": policy.seed, **policy.episode.to_dict()}
    metrics.update(model=source, settings=settings, data=a.data or f"{recipe}:{split}")
    if baseline is not None:
        metrics.update(paired_gain(metrics, baseline, str(where)))
    write_shard(out / "records", 0, 0, records_to_table([st for t in trajs for st in t.steps]))
    finalize_iteration(out / "records", 0)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    metrics["out"] = str(out)
    return metrics
