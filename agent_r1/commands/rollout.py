"""``agent-r1 rollout``: run episodes of a recipe against a model and print each one.

The policy is served as for ``eval`` (an embedded ``agent-r1 serve`` process behind the HTTP
client of training, or running servers with ``--url``, ``router=URL`` for an sglang-router);
``--hf`` runs the transformers reference in this process instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

from agent_r1 import cli_args
from agent_r1.commands.flags import add_episode_flags, add_policy_flags
from agent_r1.logging import setup_logging


def add_parser(sub: argparse._SubParsersAction) -> None:
    from recipes import RECIPES

    r = sub.add_parser("rollout", help="run episodes of a recipe against a model and print each one")
    add_policy_flags(r, many_urls=True)
    r.add_argument(
        "--hf", action="store_true", help="the transformers reference in this process (with --model)"
    )
    r.add_argument(
        "--recipe", default="arithmetic_tool", choices=RECIPES, help="generate rows from this recipe"
    )
    r.add_argument("--data", help="parquet data rows instead of --recipe")
    r.add_argument("--index", help="the search tools' retrieval index (agent-r1 index build)")
    r.add_argument("--split", default="test")
    r.add_argument("--episodes", type=cli_args.positive_int, default=16, help="number of rows (prompts)")
    r.add_argument("--group-size", type=cli_args.positive_int, default=1, help="samples per prompt")
    add_episode_flags(r)
    r.add_argument("--out", help="write the step records to this Arrow IPC file")
    r.add_argument("--no-progress", action="store_true")
    r.set_defaults(fn=run)


def run(a: argparse.Namespace) -> int:
    from agent_r1.agent.flow import AGENTS
    from agent_r1.commands.policy_source import resolve_policy, serving
    from agent_r1.data.rows import load_rows
    from recipes import load_all, load_recipe

    log = setup_logging("rollout")
    load_all()
    if a.hf and not a.model:
        raise SystemExit("agent-r1 rollout: --hf needs --model")
    policy = resolve_policy(a, Path("rollout_models"))
    seed = policy.seed
    if a.data:
        rows = load_rows(a.data, AGENTS)[: a.episodes]
    else:
        rows = load_recipe(a.recipe).build_rows(split=a.split, num=a.episodes, seed=seed)
    flow = policy.episode.flow(seed)
    log.info(
        "%d rows x %d samples, %s, %s, temperature %g",
        len(rows),
        a.group_size,
        policy.source,
        "transformers" if a.hf else " ".join(policy.urls) or "an embedded server",
        flow.sampling.temperature,
    )
    if a.hf:
        trajs = asyncio.run(_hf_episodes(a, policy, rows, flow))
    else:
        with serving(policy, a):
            trajs = policy.run_episodes(rows, a.group_size, wait_s=120, progress=not a.no_progress)
    for i, t in enumerate(trajs):
        errors = sum(s.info.get("num_tool_errors", 0) for s in t.steps)
        last = t.steps[-1] if t.steps else None
        log.info(
            "episode %3d  %-14s steps=%d tool_calls=%d tool_errors=%d reward=%.2f success=%d finish=%s%s",
            i,
            t.trajectory_id,
            len(t.steps),
            t.num_tool_calls,
            errors,
            t.total_reward,
            int(t.metrics.get("success", 0)),
            last.finish_reason if last else "-",
            " truncated" if last and last.truncated else "",
        )
    n = max(len(trajs), 1)
    summary = {
        "episodes": len(trajs),
        "mean_reward": sum(t.total_reward for t in trajs) / n,
        "success_rate": sum(t.metrics.get("success", 0.0) for t in trajs) / n,
        "mean_steps": sum(len(t.steps) for t in trajs) / n,
        "mean_tool_calls": sum(t.num_tool_calls for t in trajs) / n,
    }
    log.info("summary %s", json.dumps(summary))
    if a.out:
        from agent_r1.records.shard import write_records_file

        n = write_records_file(a.out, [s for t in trajs for s in t.steps])
        log.info("wrote %d step records to %s", n, a.out)
    return 0


async def _hf_episodes(a: argparse.Namespace, policy: Any, rows: list, flow: Any) -> list:
    """The transformers reference in this process instead of a server."""
    from agent_r1.agent.run_episodes import run_episodes
    from agent_r1.engines.hf import HFGenerator

    return await run_episodes(
        rows, HFGenerator(policy.model), policy.codec, flow, a.group_size, progress=not a.no_progress,
        services=policy.services,
    )  # fmt: skip
