"""``agent-r1 eval``: a model (an HF folder, a run directory's checkpoint, or a server / router URL)
on a recipe's split or a file of data rows, ``n`` samples per prompt.

Writes ``metrics.json`` (success and mean reward with 95% intervals, unbiased pass@k for k <= n,
steps, tool calls and errors, truncation, tokens, wall time) and the episodes as a step-record
shard. With ``--run`` and no other settings it evaluates exactly as the trainer does (its test
split, greedy, its step and token budgets, its engine settings), so the number it prints is the
trainer's held-out number for that checkpoint.
"""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent_r1.errors import AgentR1Error, UsageError

log = logging.getLogger("agent_r1.eval")
ROOT = Path(__file__).resolve().parents[1]


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


def summarize(trajs: list[Any], n: int, wall_s: float) -> dict[str, Any]:
    """Metrics of ``trajs`` (``n`` consecutive samples per prompt, as ``run_episodes`` orders them)."""
    success = [float(t.metrics.get("success", 0.0)) for t in trajs]
    reward = [float(t.metrics.get("reward", 0.0)) for t in trajs]
    lo, hi = wilson(sum(success), len(success))
    r_mean, r_lo, r_hi = mean_ci(reward)
    prompts = [success[i : i + n] for i in range(0, len(success), n)]
    steps = [len(t.steps) for t in trajs]
    out: dict[str, Any] = {
        "episodes": len(trajs),
        "prompts": len(prompts),
        "samples_per_prompt": n,
        "success": sum(success) / max(len(success), 1),
        "success_ci95": [lo, hi],
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
    }
    return out


@dataclass
class EvalSettings:
    """What the trainer's evaluation uses; ``from_run`` reads them from a run's config."""

    recipe: str
    split: str
    num: int
    temperature: float
    top_p: float
    seed: int
    max_steps: int
    max_obs_tokens: int
    max_action_tokens: int
    max_len: int
    dtype: str


def newest_checkpoint(run: Path, iteration: int | None, strict: bool = False) -> Path:
    """The checkpoint of ``iteration``, else the newest one that passes its checksums: a damaged
    newer one is skipped with a warning naming its file (``strict``: an error)."""
    from agent_r1.learner.checkpoint_files import CheckpointError, verify_checksums
    from agent_r1.records.shard import iteration_dirs

    done = {
        i: p for i, p in iteration_dirs(run / "checkpoints").items() if (p / "agent_r1_state.json").exists()
    }
    if not done:
        raise AgentR1Error(f"{run} has no complete checkpoint under {run / 'checkpoints'}")
    if iteration is not None:
        if iteration not in done:
            raise UsageError(f"--iteration {iteration}: {run} has no checkpoint of it (have {sorted(done)})")
        verify_checksums(done[iteration])
        return done[iteration]
    damaged = []
    for i in sorted(done, reverse=True):
        try:
            verify_checksums(done[i])
        except CheckpointError as e:
            if strict:
                raise
            log.warning("skipping damaged checkpoint: %s", e)
            damaged.append(done[i].name)
            continue
        if damaged:
            log.warning("using %s, the newest intact checkpoint (damaged: %s)", done[i], ", ".join(damaged))
        return done[i]
    raise AgentR1Error(f"{run}: every checkpoint is damaged ({', '.join(damaged)}); see the warnings above")


def check_budget(max_obs_tokens: int, max_action_tokens: int, max_len: int) -> None:
    """An observation at its budget must leave room in the server's context for a full action."""
    if max_obs_tokens + max_action_tokens > max_len:
        raise UsageError(
            f"--max-obs-tokens {max_obs_tokens} + --max-action-tokens {max_action_tokens} do not fit"
            f" --max-len {max_len} (the server's context)"
        )


def export_checkpoint(ckpt: Path, hf_like: Path, out: Path, dtype: str | None = None) -> Path:
    """A Megatron checkpoint of any TP/PP layout -> an HF folder with the tokenizer and chat template
    of ``hf_like`` (``tools/convert_checkpoint.py`` in its own process), optionally cast to ``dtype``."""
    if (out / "model.safetensors").exists():
        return out
    cmd = [sys.executable, str(ROOT / "tools" / "convert_checkpoint.py"), "megatron-to-hf",
           "--ckpt", str(ckpt), "--hf", str(hf_like), "--out", str(out)]  # fmt: skip
    r = subprocess.run([*cmd, *(["--dtype", dtype] if dtype else [])], capture_output=True, text=True)
    if r.returncode != 0:
        lines = [x for x in r.stderr.splitlines() if x.strip()]
        raise AgentR1Error(f"exporting {ckpt} failed: {lines[-1] if lines else f'exit {r.returncode}'}")
    return out


def resolve_model(a: Any, export_dir: Path) -> tuple[Any, str | None, str]:
    """(the run's config or None, an HF folder or None for ``--url``, what is evaluated) of
    ``--model`` / ``--run [--iteration]`` / ``--url``; a run's checkpoint is exported under
    ``export_dir``. Errors say what is wrong with which path."""
    if sum(bool(x) for x in (a.model, a.run, a.url)) != 1:
        raise UsageError("give one of --model DIR, --run RUN_DIR or --url URL")
    if a.model and not (Path(a.model) / "config.json").exists():
        raise UsageError(f"--model {a.model}: not an HF model folder (no config.json)")
    if not a.run:
        return None, a.model, a.model or a.url
    from agent_r1.train.config import from_yaml

    run = Path(a.run)
    if not (run / "config.yaml").exists():
        raise UsageError(f"--run {run}: not a run directory (no config.yaml)")
    cfg = from_yaml(run / "config.yaml")
    ckpt = newest_checkpoint(run, a.iteration, getattr(a, "strict", False))
    log.info("exporting %s to an HF folder", ckpt)
    return cfg, str(export_checkpoint(ckpt, Path(cfg.model.path), export_dir / f"hf_{ckpt.name}")), str(ckpt)


def start_server(model: str, max_len: int, dtype: str, threads: int | None) -> tuple[subprocess.Popen, str]:
    """``agent-r1 serve`` on a free loopback port, as its own process (as the trainer's servers)."""
    import tempfile

    from agent_r1.process import die_with_parent

    tmp = Path(tempfile.mkdtemp(prefix="agent_r1_eval_"))
    ready, log_path = tmp / "server.json", tmp / "server.log"
    cmd = [sys.executable, "-m", "agent_r1.cli", "serve", "--model", model, "--port", "0",
           "--max-len", str(max_len), "--dtype", dtype, "--ready-file", str(ready), "--strict"]  # fmt: skip
    if threads:
        cmd += ["--threads", str(threads)]
    # its own session: a Ctrl-C at the terminal (a chat's) reaches this process, not the server
    # its log goes to a file (a pipe nobody drains would stop the server once it filled)
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.DEVNULL,
            stderr=log_file,
            preexec_fn=die_with_parent(),
            start_new_session=True,
        )
    deadline = time.time() + 300
    while not ready.exists():
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-2000:]
            raise AgentR1Error(f"the embedded server failed to start: {tail}")
        if time.time() > deadline:
            proc.kill()
            raise AgentR1Error("the embedded server did not start within 300 s")
        time.sleep(0.1)
    return proc, json.loads(ready.read_text())["url"]


def settings(a: Any, cfg: Any) -> EvalSettings:
    """The trainer's evaluation settings (``cfg``: a run's config), each overridden by the command
    line where given; without a run, the command line's (or their defaults)."""

    def pick(arg: Any, from_run: Any, default: Any) -> Any:
        return arg if arg is not None else (from_run if cfg is not None else default)

    c = cfg
    return EvalSettings(
        recipe=pick(a.recipe, c and c.recipe.name, "arithmetic_tool"),
        split=pick(a.split, "test", "test"),
        num=pick(a.num, c and c.recipe.test_size, 64),
        temperature=pick(a.temperature, c and c.trainer.eval_temperature, 0.0),
        top_p=pick(a.top_p, 1.0, 1.0),
        seed=pick(a.seed, c and c.trainer.seed, 0),
        max_steps=pick(a.max_steps, c and c.rollout.max_steps, 8),
        max_obs_tokens=pick(a.max_obs_tokens, c and c.rollout.max_obs_tokens, 1536),
        max_action_tokens=pick(a.max_action_tokens, c and c.rollout.max_action_tokens, 96),
        max_len=pick(a.max_len, c and c.model.max_len, 2048),
        dtype=pick(a.dtype, c and c.model.dtype, "float32"),
    )


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


def run_eval(a: Any) -> dict[str, Any]:
    """The ``agent-r1 eval`` command: returns the metrics it wrote to ``OUT/metrics.json``."""
    import asyncio

    from agent_r1.agent.chat import ChatCodec
    from agent_r1.agent.episodes import run_episodes
    from agent_r1.agent.flow import AGENTS, FlowConfig
    from agent_r1.agent.types import SamplingParams
    from agent_r1.data.rows import load_rows
    from agent_r1.records.schema import records_to_table
    from agent_r1.records.shard import finalize_iteration, write_shard
    from agent_r1.rollout.client import RolloutClient
    from recipes import load_all, load_recipe

    load_all()
    # a run's evaluations without --out share one export of each checkpoint (RUN/evals/hf_iter_N)
    exports = Path(a.out or (Path(a.run) / "evals" if a.run else "eval_out"))
    exports.mkdir(parents=True, exist_ok=True)
    cfg, model, source = resolve_model(a, exports)
    out = Path(a.out) if a.out else default_out(a, source)
    out.mkdir(parents=True, exist_ok=True)
    from agent_r1.retrieval import client as retrieval

    if getattr(a, "index", None):  # the search tools' index, in this process
        retrieval.set_default(retrieval.LocalRetriever(retrieval.open_index(a.index)))
    elif cfg is not None and cfg.retrieval.index:
        retrieval.set_default(
            retrieval.LocalRetriever(retrieval.open_index(cfg.retrieval.index, cfg.retrieval.mode))
        )
    s = settings(a, cfg)
    check_budget(s.max_obs_tokens, s.max_action_tokens, s.max_len)
    if a.data:
        rows = load_rows(a.data, AGENTS)[: s.num]
    elif cfg is not None and a.recipe is None and a.split is None:
        from agent_r1.train.rows import split_rows

        rows = split_rows(cfg, "test", s.num)  # exactly the trainer's held-out rows
    else:
        r = cfg.recipe if cfg is not None else None
        opts = dict(r.options) if r is not None and r.name == s.recipe else {}
        rows = load_recipe(s.recipe).build_rows(split=s.split, num=s.num, seed=r.seed if r else 0, **opts)
    tokenizer = a.tokenizer or model or (cfg.model.path if cfg is not None else None)
    if tokenizer is None:
        raise UsageError("--url needs --tokenizer (an HF folder with the model's tokenizer)")
    codec = ChatCodec.load(tokenizer)
    sampling = SamplingParams(
        temperature=s.temperature, top_p=s.top_p, max_new_tokens=s.max_action_tokens, seed=s.seed
    )
    flow = FlowConfig(s.max_steps, s.max_obs_tokens, s.max_action_tokens, sampling=sampling)
    proc = None
    if a.url:
        url = a.url
    else:
        threads = cfg.rollout.server_cpus if cfg is not None else None
        proc, url = start_server(model, s.max_len, s.dtype, threads)
    concurrency = cfg.rollout.max_concurrency if cfg is not None else 64
    t0 = time.time()
    try:
        client = RolloutClient(servers=[url], api_key=a.api_key)

        async def go():
            try:
                return await run_episodes(
                    rows, client, codec, flow, a.n, id_prefix="eval", max_concurrency=concurrency,
                    progress=not a.no_progress,
                )  # fmt: skip
            finally:
                await client.close()

        trajs = asyncio.run(go())
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    metrics = summarize(trajs, a.n, time.time() - t0)
    metrics.update(model=source, settings=s.__dict__, data=a.data or f"{s.recipe}:{s.split}")
    write_shard(out / "records", 0, 0, records_to_table([st for t in trajs for st in t.steps]))
    finalize_iteration(out / "records", 0)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    metrics["out"] = str(out)
    return metrics
