"""``agent-r1``: the single entry point. Subcommands grow with the project."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import NoReturn

from agent_r1 import cli_args
from agent_r1.errors import expected_failure, one_line
from agent_r1.logging import setup_logging


def _rollout(a: argparse.Namespace) -> int:

    from agent_r1.agent.chat import ChatCodec
    from agent_r1.agent.flow import AGENTS, FlowConfig
    from agent_r1.agent.types import SamplingParams
    from agent_r1.data.rows import load_rows
    from recipes import load_all, load_recipe

    log = setup_logging("rollout")
    load_all()
    if a.index:
        from agent_r1.retrieval import client as retrieval

        retrieval.set_default(retrieval.LocalRetriever(retrieval.open_index(a.index)))
    if a.data:
        rows = load_rows(a.data, AGENTS)[: a.episodes]
    else:
        rows = load_recipe(a.recipe).build_rows(split=a.split, num=a.episodes, seed=a.seed)
    codec = ChatCodec.load(a.model)
    sampling = SamplingParams(
        temperature=a.temperature, top_p=a.top_p, max_new_tokens=a.max_action_tokens, seed=a.seed
    )
    config = FlowConfig(
        max_steps=a.max_steps,
        max_obs_tokens=a.max_obs_tokens,
        max_action_tokens=a.max_action_tokens,
        sampling=sampling,
    )
    log.info(
        "%d rows x %d samples, model %s, engine %s, temperature %g",
        len(rows),
        a.group_size,
        a.model,
        a.engine,
        a.temperature,
    )
    trajs = asyncio.run(_run_with_engine(a, rows, codec, config))
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


async def _run_with_engine(a: argparse.Namespace, rows, codec, config):
    """Episodes through the chosen engine: ``embedded`` = an `agent-r1 serve` process on a free loopback
    port behind the same HTTP client used for SGLang; ``hf`` = the transformers reference; a URL =
    external servers (comma-separated) or an sglang-router (``router=URL``)."""
    from agent_r1.agent.episodes import run_episodes
    from agent_r1.rollout.client import RolloutClient

    if a.engine == "hf":
        from agent_r1.rollout.hf import HFGenerator

        return await run_episodes(
            rows, HFGenerator(a.model), codec, config, a.group_size, progress=not a.no_progress
        )
    proc = None
    if a.engine == "embedded":
        from agent_r1.evaluate import start_server

        proc, url = start_server(a.model, a.max_obs_tokens + a.max_action_tokens, "float32", None)
        client = RolloutClient(servers=[url])
    elif a.engine.startswith("router="):
        client = RolloutClient(router=a.engine.split("=", 1)[1])
    else:
        client = RolloutClient(servers=a.engine.split(","))
    try:
        await client.wait_ready(120)
        return await run_episodes(rows, client, codec, config, a.group_size, progress=not a.no_progress)
    finally:
        await client.close()
        if proc is not None:
            proc.terminate()
            proc.wait(30)


def _data(a: argparse.Namespace) -> int:
    from agent_r1.data.rows import write_rows
    from recipes import load_recipe

    log = setup_logging("data")
    try:
        rows = load_recipe(a.recipe).build_rows(split=a.split, num=a.num, seed=a.seed)
    except (KeyError, ValueError, FileNotFoundError) as e:  # an unknown recipe or split, missing files
        print(f"agent-r1 data: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    log.info("wrote %d rows to %s", len(rows), write_rows(rows, a.out))
    return 0


def _eval(a: argparse.Namespace) -> int:
    from agent_r1.evaluate import run_eval

    if sum(x is not None for x in (a.model, a.run, a.url)) != 1:
        print("agent-r1 eval: give exactly one of --model, --run, --url", file=sys.stderr)
        return 2
    setup_logging("eval")
    m = run_eval(a)
    lo, hi = m["success_ci95"]
    passes = " ".join(f"pass@{k} {v:.3f}" for k, v in m["pass_at_k"].items())
    print(
        f"eval {m['data']}: success {m['success']:.3f} [{lo:.3f}, {hi:.3f}] over {m['episodes']} episodes"
        f" ({m['prompts']} prompts x {m['samples_per_prompt']}); {passes}; reward {m['reward']:.3f};"
        f" steps {m['steps_per_episode']:.2f} tools {m['tool_calls_per_episode']:.2f}\n"
        f"metrics:  {m['out']}/metrics.json\nepisodes: {m['out']}/records",
        flush=True,
    )
    return 0


def _infer(a: argparse.Namespace) -> int:
    from agent_r1.infer import run_infer

    setup_logging("infer")
    m = run_infer(a)
    ok = "" if m["success"] is None else f"; success {m['success']:.3f} over {m['scored']} scored episodes"
    print(
        f"infer: {m['episodes']} episodes of {m['prompts']} prompts ({m['new_prompts']} new, "
        f"{m['wall_seconds']:.1f} s){ok}\nanswers: {a.out}",
        flush=True,
    )
    return 0


def _chat(a: argparse.Namespace) -> int:
    import logging

    from agent_r1.chat_cli import run_chat

    logging.basicConfig(level=logging.WARNING)  # the terminal is the chat's
    return run_chat(a)


def _view(a: argparse.Namespace) -> int:
    from agent_r1.viewer import write_view

    setup_logging("view")
    out, d = write_view(a.run_dir, a.out, a.groups_per_iteration, a.strict)
    print(
        f"{out}: {d['shown_trajectories']} of {d['total_trajectories']} trajectories, "
        f"{d['file_bytes'] / 1e6:.2f} MB; open it in a browser (no server needed)",
        flush=True,
    )
    return 0


def _env_serve(a: argparse.Namespace) -> int:
    from agent_r1.train.env_server import recipe_server

    setup_logging("env")
    try:
        server = recipe_server(a.recipe)
    except ValueError as e:
        raise SystemExit(f"agent-r1 env serve: {e}") from None
    options = {k: v for k, v in (("data", a.data), ("human", a.human)) if v}
    return server.serve(a.host, a.port, a.ready_file, _api_key(a), None, seed=a.seed, **options)


def _export(a: argparse.Namespace) -> int:
    from agent_r1.evaluate import export_checkpoint, newest_checkpoint
    from agent_r1.train.config import from_yaml

    setup_logging("export")
    run = Path(a.run_dir)
    cfg = from_yaml(run / "config.yaml")
    ckpt = newest_checkpoint(run, a.iteration, a.strict)
    out = export_checkpoint(ckpt, Path(cfg.model.path), Path(a.out), a.dtype)
    print(
        f"exported {ckpt} -> {out} ({a.dtype or 'float32'}); serve it: agent-r1 serve --model {out}",
        flush=True,
    )
    return 0


def _serve(a: argparse.Namespace) -> int:
    from agent_r1.rollout.server import serve
    from agent_r1.serving.openai_api import OpenAIRoutes

    setup_logging("server")
    name = a.served_model_name or Path(a.model).resolve().name
    serve(
        a.model,
        a.host,
        a.port,
        a.ready_file,
        routes=lambda server: OpenAIRoutes(server, name),  # SGLang serves them too
        dtype=a.dtype,
        max_running=a.max_running,
        max_len=a.max_len,
        prefill_chunk=a.prefill_chunk,
        threads=a.threads,
        device=a.device,
        weight_ipc=a.weight_ipc,
        api_key=_api_key(a),
        max_body_mb=a.max_body_mb,
        strict=a.strict,
        sglang_version=a.sglang_version,
        join_timeout_s=a.join_timeout_s,
    )
    return 0


def _api_key(a: argparse.Namespace) -> str | None:
    if a.api_key and a.api_key_file:
        raise SystemExit("give --api-key or --api-key-file, not both")
    if a.api_key_file:
        key = Path(a.api_key_file).read_text().strip()
        if not key:
            raise SystemExit(f"--api-key-file {a.api_key_file} is empty")
        return key
    return a.api_key


def _train(a: argparse.Namespace) -> int:
    from agent_r1.train.config import ConfigError, load_config, to_yaml

    setup_logging("launcher")
    try:
        cfg = load_config(a.overrides)
    except ConfigError as e:
        print(f"agent-r1 train: {e}", file=sys.stderr)
        return 2
    if a.print_config:
        print(to_yaml(cfg), end="")
        return 0
    if cfg.cluster.launcher != "local":
        print(
            "agent-r1 train runs locally; use `agent-r1 launch` for cluster.launcher=slurm", file=sys.stderr
        )
        return 2
    from agent_r1.train.launcher import train_local
    from agent_r1.train.run_dir import RunDirBusy

    try:
        return train_local(cfg)
    except (RunDirBusy, ConfigError) as e:
        print(f"agent-r1 train: {e}", file=sys.stderr)
        return 2


def _launch(a: argparse.Namespace) -> int:
    from agent_r1.train.config import ConfigError
    from agent_r1.train.plan import PlanError
    from agent_r1.train.run_dir import RunDirBusy
    from agent_r1.train.slurm import SlurmError, launch

    try:
        out = launch(a.overrides, dry_run=a.dry_run, plan=not a.no_plan)
    except (ConfigError, SlurmError, RunDirBusy, PlanError) as e:
        print(f"agent-r1 launch: {e}", file=sys.stderr)
        return 2
    if a.dry_run:
        print(out["script"], end="")
        return 0
    print(
        f"submitted job {out['job_id']}\nrun dir:     {out['run_dir']}\nscript:      {out['script']}\n"
        f"logs:        {' '.join(out['logs'])}\nTensorBoard: {out['tensorboard']}\n"
        f"watch:       squeue -j {out['job_id']}; tail -f {out['logs'][0]}"
    )
    return 0


def _plan(a: argparse.Namespace) -> int:
    """Exit 0 when the run fits, 1 when it does not (or a stage failed to plan)."""
    from agent_r1.train.plan import plan, to_json

    p = plan(a.overrides)
    print(to_json(p) if a.json else p.table())
    return 0 if p.fits else 1


def _sweep(a: argparse.Namespace) -> int:
    from agent_r1.train.config import ConfigError
    from agent_r1.train.slurm import SlurmError, sweep

    try:
        out = sweep(a.config, a.overrides, dry_run=a.dry_run, out_dir=a.out)
    except (ConfigError, SlurmError) as e:
        print(f"agent-r1 sweep: {e}", file=sys.stderr)
        return 2
    if a.dry_run:
        for t in out["tasks"]:
            print(f"# task {t['index']}: {' '.join(t['overrides'])}")
        print(out["script"], end="")
        if out["tasks"] and "job" in out["tasks"][0]:  # a cluster layout: each task runs its own job body
            print(f"# ---- task_000/job.sh (each task runs its own) ----\n{out['tasks'][0]['job']}", end="")
        return 0
    print(
        f"submitted job array {out['job_id']} ({out['tasks']} tasks)\nsweep dir:   {out['sweep_dir']}\n"
        f"TensorBoard: {out['tensorboard']}\nreport:      {out['report']}"
    )
    return 0


def _sweep_task(a: argparse.Namespace) -> int:
    from agent_r1.train.slurm import sweep_task

    setup_logging("sweep")
    return sweep_task(a.sweep_json, a.index)


def _role(a: argparse.Namespace) -> int:
    from agent_r1.train.roles import run_role, supervise

    if a.supervise:
        return supervise(a.role, a.run_dir, a.index, a.max_restarts)
    return run_role(a.role, a.run_dir, a.index)


def _index_build(a: argparse.Namespace) -> int:
    from agent_r1.retrieval.index import build_index

    setup_logging("index")
    if a.corpus:
        passages, source = a.corpus, a.corpus
    elif a.dataset:
        from recipes.hotpotqa.loaders import DatasetError, dataset_passages

        try:
            passages, source = dataset_passages(a.dataset), " ".join(a.dataset)
        except DatasetError as e:
            raise SystemExit(f"agent-r1 index build: {e}") from None
    else:
        from recipes import load_recipe

        passages, source = (
            load_recipe(a.recipe).passages(seed=a.seed),
            f"recipe {a.recipe} seed {a.seed} (command line)",
        )
    try:
        meta = build_index(passages, a.out, dense=a.dense, source=source)
    except (ValueError, OSError) as e:  # a missing or malformed corpus: named by the reader
        raise SystemExit(f"agent-r1 index build: {e}") from None
    print(json.dumps(meta))
    return 0


def _retriever_serve(a: argparse.Namespace) -> int:
    from agent_r1.retrieval.server import serve_retriever

    setup_logging("retriever")
    return serve_retriever(a.index, a.host, a.port, a.ready_file, _api_key(a), a.mode)


class Parser(argparse.ArgumentParser):
    """A usage error is one line (and where to read more), not the whole usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from recipes import RECIPES

    p = Parser(prog="agent-r1", description="Slurm-native end-to-end RL for multi-step LLM agents.")
    p.add_argument(
        "--debug",
        action="store_true",
        help="a traceback for every failure (default: one line for expected ones)",
    )
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("rollout", help="run episodes of a recipe with a local HF model and print each one")
    r.add_argument("--model", required=True, help="HF model folder (e.g. built by tools/make_tiny_model.py)")
    r.add_argument(
        "--recipe", default="arithmetic_tool", choices=RECIPES, help="generate rows from this recipe"
    )
    r.add_argument("--data", help="parquet data rows instead of --recipe")
    r.add_argument("--index", help="the search tools' retrieval index (agent-r1 index build)")
    r.add_argument("--split", default="test")
    r.add_argument("--episodes", type=cli_args.positive_int, default=16, help="number of rows (prompts)")
    r.add_argument("--group-size", type=cli_args.positive_int, default=1, help="samples per prompt")
    r.add_argument("--temperature", type=cli_args.nonneg_float, default=0.0, help="0 = greedy")
    r.add_argument("--top-p", type=cli_args.probability, default=1.0)
    r.add_argument("--max-steps", type=cli_args.positive_int, default=8)
    r.add_argument("--max-obs-tokens", type=cli_args.positive_int, default=1536)
    r.add_argument("--max-action-tokens", type=cli_args.positive_int, default=96)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--engine", default="embedded", help="embedded (default) | hf | URL[,URL...] | router=URL")
    r.add_argument("--out", help="write the step records to this Arrow IPC file")
    r.add_argument("--no-progress", action="store_true")
    r.set_defaults(fn=_rollout)

    d = sub.add_parser("data", help="write a recipe's data rows to parquet")
    d.add_argument("--recipe", required=True, choices=RECIPES)
    d.add_argument("--split", default="train")
    d.add_argument("--num", type=cli_args.positive_int, default=64)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--out", required=True)
    d.set_defaults(fn=_data)

    ev = sub.add_parser("eval", help="evaluate a model, a run's checkpoint or a server on a held-out split")
    ev.add_argument("--model", help="an HF model folder")
    ev.add_argument(
        "--run", help="a run directory: its newest (or --iteration) checkpoint, the trainer's eval settings"
    )
    ev.add_argument(
        "--iteration", type=cli_args.nonneg_int, default=None, help="with --run: this iteration's checkpoint"
    )
    ev.add_argument("--url", help="a running server or sglang-router (needs --tokenizer)")
    ev.add_argument("--tokenizer", help="HF folder of the tokenizer (default: the model's)")
    ev.add_argument("--api-key", default=None, help="the server's API key (with --url)")
    ev.add_argument("--recipe", default=None, choices=RECIPES)
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
    ev.add_argument(
        "--temperature",
        type=cli_args.nonneg_float,
        default=None,
        help="default: the run's eval temperature, else 0",
    )
    ev.add_argument("--top-p", type=cli_args.probability, default=None)
    ev.add_argument("--seed", type=int, default=None)
    ev.add_argument("--max-steps", type=cli_args.positive_int, default=None)
    ev.add_argument("--max-obs-tokens", type=cli_args.positive_int, default=None)
    ev.add_argument("--max-action-tokens", type=cli_args.positive_int, default=None)
    ev.add_argument(
        "--max-len", type=cli_args.positive_int, default=None, help="the embedded server's context length"
    )
    ev.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    ev.add_argument(
        "--out",
        default=None,
        help="metrics.json and the episodes' records go here (default: RUN/evals/SPLIT-CHECKPOINT[-nN][-TT][-sS]"
        " with --run, else ./eval_out)",
    )
    ev.add_argument(
        "--index", default=None, help="the search tools' index (default: the run's retrieval.index)"
    )
    ev.add_argument("--no-progress", action="store_true")
    ev.add_argument(
        "--strict",
        action="store_true",
        help="with --run: a damaged newest checkpoint is an error (default: the newest intact)",
    )
    ev.set_defaults(fn=_eval)

    inf = sub.add_parser("infer", help="batch inference: prompts or data rows -> episodes -> JSON lines")
    inf.add_argument(
        "--input", required=True, help="rows.parquet, or JSON lines / a JSON list of prompts or rows"
    )
    inf.add_argument("--out", required=True, help="answers.jsonl (resumed when it exists)")
    inf.add_argument("--model", help="an HF model folder")
    inf.add_argument("--run", help="a run directory: its newest (or --iteration) checkpoint")
    inf.add_argument("--iteration", type=cli_args.nonneg_int, default=None)
    inf.add_argument("--url", action="append", help="a running server or router (repeat for several)")
    inf.add_argument(
        "--servers", type=cli_args.positive_int, default=1, help="embedded servers to start (without --url)"
    )
    inf.add_argument("--tokenizer", help="HF folder of the tokenizer (default: the model's)")
    inf.add_argument("--api-key", default=None)
    inf.add_argument(
        "--recipe", default=None, choices=RECIPES, help="open prompts run as this recipe's agent"
    )
    inf.add_argument("--tools", default=None, help="open prompts run as a tool agent: calculator,search")
    inf.add_argument("--index", default=None, help="the search tools' index")
    inf.add_argument("--n", type=cli_args.positive_int, default=1, help="samples per prompt")
    inf.add_argument("--temperature", type=cli_args.nonneg_float, default=0.0)
    inf.add_argument("--top-p", type=cli_args.probability, default=1.0)
    inf.add_argument("--seed", type=int, default=0)
    inf.add_argument("--max-steps", type=cli_args.positive_int, default=8)
    inf.add_argument("--max-obs-tokens", type=cli_args.positive_int, default=1536)
    inf.add_argument("--max-action-tokens", type=cli_args.positive_int, default=256)
    inf.add_argument(
        "--max-len", type=cli_args.positive_int, default=2048, help="the embedded servers' context length"
    )
    inf.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    inf.add_argument(
        "--chunk", type=cli_args.positive_int, default=64, help="prompts per written chunk (the resume unit)"
    )
    inf.add_argument("--concurrency", type=cli_args.positive_int, default=64, help="episodes in flight")
    inf.add_argument("--no-progress", action="store_true")
    inf.set_defaults(fn=_infer)

    ch = sub.add_parser("chat", help="talk to a model with a recipe's tools in the terminal")
    ch.add_argument("--model", help="an HF model folder")
    ch.add_argument("--run", help="a run directory: its newest (or --iteration) checkpoint")
    ch.add_argument("--iteration", type=cli_args.nonneg_int, default=None)
    ch.add_argument("--url", help="a running SGLang / agent-r1 server or router (needs --tokenizer)")
    ch.add_argument("--tokenizer", help="HF folder of the tokenizer (default: the model's)")
    ch.add_argument("--api-key", default=None)
    ch.add_argument("--recipe", default=None, choices=RECIPES, help="its agent, tools and system prompt")
    ch.add_argument("--tools", default=None, help="a tool agent with these tools: calculator,search")
    ch.add_argument("--system", default=None, help="the system prompt (default: the recipe's)")
    ch.add_argument("--index", default=None, help="the search tool's index")
    ch.add_argument("--temperature", type=cli_args.nonneg_float, default=0.0)
    ch.add_argument("--top-p", type=cli_args.probability, default=1.0)
    ch.add_argument("--seed", type=int, default=None)
    ch.add_argument("--max-steps", type=cli_args.positive_int, default=8, help="agent steps per user message")
    ch.add_argument("--max-obs-tokens", type=cli_args.positive_int, default=4096)
    ch.add_argument("--max-action-tokens", type=cli_args.positive_int, default=512)
    ch.add_argument(
        "--max-len", type=cli_args.positive_int, default=8192, help="the embedded engine's context length"
    )
    ch.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ch.add_argument("--export-dir", default="chat_models", help="where --run's checkpoint is exported")
    ch.add_argument("--no-color", action="store_true")
    ch.set_defaults(fn=_chat)

    en = sub.add_parser("env", help="a recipe's environment as a service")
    ens = en.add_subparsers(dest="env_command", required=True)
    es = ens.add_parser("serve", help="serve a recipe's environment (e.g. webshop) over HTTP")
    es.add_argument("recipe")
    es.add_argument("--host", default="127.0.0.1")
    es.add_argument("--port", type=cli_args.port, default=0, help="0 = any free port")
    es.add_argument("--ready-file", default=None, help='written with {"url"} once serving')
    es.add_argument("--data", default=None, help="the recipe's data folder (webshop: WebShop's files)")
    es.add_argument("--human", action="store_true", help="webshop: the human instructions")
    es.add_argument("--seed", type=int, default=0)
    es.add_argument("--api-key", default=None)
    es.add_argument("--api-key-file", default=None)
    es.set_defaults(fn=_env_serve)

    vw = sub.add_parser("view", help="a run's trajectories as one self-contained HTML file")
    vw.add_argument("run_dir")
    vw.add_argument("--out", default=None, help="default: RUN_DIR/view.html")
    vw.add_argument(
        "--groups-per-iteration",
        type=int,
        default=8,
        help="groups shown per iteration (chosen evenly, seeded)",
    )
    vw.add_argument("--strict", action="store_true", help="a damaged iteration is an error (default: marked)")
    vw.set_defaults(fn=_view)

    ix = sub.add_parser("index", help="retrieval indexes for search tools")
    ixs = ix.add_subparsers(dest="index_command", required=True)
    ib = ixs.add_parser("build", help="a passage corpus -> an index folder (bm25s; --dense adds MiniLM)")
    src = ib.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--corpus", help='passages, one JSON per line: {"id", "contents"} or {"id", "title", "text"}'
    )
    src.add_argument("--dataset", nargs="+", help="the passages of HotpotQA / 2Wiki / MuSiQue files")
    src.add_argument("--recipe", choices=RECIPES, help="a recipe's own passages (the offline world)")
    ib.add_argument("--seed", type=int, default=0, help="with --recipe")
    ib.add_argument("--out", required=True)
    ib.add_argument("--dense", action="store_true", help="also the dense MiniLM index")
    ib.set_defaults(fn=_index_build)

    rv = sub.add_parser("retriever", help="serve an index over HTTP (Search-R1's /retrieve API)")
    rvs = rv.add_subparsers(dest="retriever_command", required=True)
    rs = rvs.add_parser("serve")
    rs.add_argument("--index", required=True)
    rs.add_argument("--host", default="127.0.0.1")
    rs.add_argument("--port", type=cli_args.port, default=8000)
    rs.add_argument("--mode", default="sparse", choices=["sparse", "dense", "hybrid"])
    rs.add_argument("--ready-file", default=None, help='written with {"url"} once serving')
    rs.add_argument("--api-key", default=None)
    rs.add_argument("--api-key-file", default=None)
    rs.set_defaults(fn=_retriever_serve)

    ex = sub.add_parser("export", help="a run's checkpoint (any TP/PP) -> an HF folder with its tokenizer")
    ex.add_argument("run_dir")
    ex.add_argument(
        "--iteration", type=cli_args.nonneg_int, default=None, help="default: the newest complete checkpoint"
    )
    ex.add_argument("--out", required=True)
    ex.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    ex.add_argument("--strict", action="store_true", help="a damaged newest checkpoint is an error")
    ex.set_defaults(fn=_export)

    sv = sub.add_parser("serve", help="the embedded rollout engine behind SGLang's HTTP API")
    sv.add_argument("--model", required=True, help="HF model folder")
    sv.add_argument(
        "--served-model-name",
        default=None,
        help="the model's id in the OpenAI API (default: the folder name)",
    )
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=cli_args.port, default=30000, help="0 = any free port")
    sv.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    sv.add_argument(
        "--max-running", type=cli_args.positive_int, default=64, help="concurrent requests (KV slots)"
    )
    sv.add_argument(
        "--max-len", type=cli_args.positive_int, default=None, help="tokens per request (prompt + output)"
    )
    sv.add_argument(
        "--prefill-chunk", type=cli_args.positive_int, default=2048, help="prefill tokens per scheduler step"
    )
    sv.add_argument("--threads", type=cli_args.positive_int, default=None, help="torch threads")
    sv.add_argument("--device", default="cpu", help="where the model and KV cache live: cpu, cuda, cuda:N")
    sv.add_argument(
        "--weight-ipc",
        action="store_true",
        help="accept /update_weights_from_tensor (CUDA IPC / shared memory from a trainer on this machine)",
    )
    sv.add_argument(
        "--ready-file", help="write {url} here once listening (run_dir/control/servers/NAME.json)"
    )
    sv.add_argument(
        "--api-key", help="require `Authorization: Bearer KEY` on every endpoint but /health (as SGLang)"
    )
    sv.add_argument("--api-key-file", help="read the API key from this file (keeps it out of `ps`)")
    sv.add_argument(
        "--max-body-mb",
        type=cli_args.positive_int,
        default=256,
        help="larger request bodies are refused with 413",
    )
    sv.add_argument(
        "--strict",
        action="store_true",
        help="serve only the endpoints upstream SGLang serves (404 for the rest): what the trainer uses",
    )
    sv.add_argument(
        "--sglang-version",
        help="the SGLang release whose protocol to speak (default: the newest checked, 0.5.23; before "
        "0.5.21 weights load without an update session)",
    )
    sv.add_argument(
        "--join-timeout-s",
        type=cli_args.nonneg_float,
        default=120.0,
        help="how long /init_weights_update_group waits for the trainer's rendezvous",
    )
    sv.set_defaults(fn=_serve)

    tr = sub.add_parser(
        "train",
        help="RL training, all roles on this machine (Hydra overrides: +experiment=quickstart algorithm=steppo)",
    )
    tr.add_argument(
        "overrides", nargs="*", help="Hydra overrides, e.g. +experiment=quickstart rollout.group_size=4"
    )
    tr.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    tr.set_defaults(fn=_train)

    la = sub.add_parser("launch", help="submit a run to Slurm as one heterogeneous job (--dry-run prints it)")
    la.add_argument(
        "overrides", nargs="*", help="Hydra overrides, e.g. +experiment=qwen3_4b_gsm8k_tool_steppo_4n8g"
    )
    la.add_argument("--dry-run", action="store_true", help="print the sbatch script, submit nothing")
    la.add_argument(
        "--no-plan", action="store_true", help="submit without the memory plan (`agent-r1 plan`) of a GPU run"
    )
    la.set_defaults(fn=_launch)

    pl = sub.add_parser(
        "plan",
        help="a run's learner and rollout memory per GPU, from a dry run of the real code on no GPU",
    )
    pl.add_argument(
        "overrides", nargs="*", help="Hydra overrides, e.g. +experiment=qwen3_4b_gsm8k_tool_steppo_4n8g"
    )
    pl.add_argument("--json", action="store_true", help="the plan as JSON instead of the table")
    pl.set_defaults(fn=_plan)

    sw = sub.add_parser("sweep", help="a grid or list of overrides as one Slurm job array")
    sw.add_argument("config", help="sweep YAML: name, base, grid | list, max_parallel")
    sw.add_argument("overrides", nargs="*", help="extra overrides for every task")
    sw.add_argument("--dry-run", action="store_true")
    sw.add_argument("--out", help="sweep directory (default runs/sweeps/NAME)")
    sw.set_defaults(fn=_sweep)

    st = sub.add_parser("sweep-task", help="one task of a sweep (run by the job array)")
    st.add_argument("sweep_json")
    st.add_argument("index", type=int)
    st.set_defaults(fn=_sweep_task)

    ro = sub.add_parser("role", help="run one role of a run (used by the launchers and Slurm jobs)")
    ro.add_argument(
        "role",
        help="learner, server, worker, router, retriever, or a helper model's name (teacher, selector, ...)",
    )
    ro.add_argument(
        "--supervise",
        action="store_true",
        help="run the role as a child and restart it when it dies (Slurm steps of rollout roles)",
    )
    ro.add_argument(
        "--max-restarts",
        type=cli_args.nonneg_int,
        default=5,
        help="with --supervise: restarts before giving up",
    )
    ro.add_argument("--run-dir", required=True)
    ro.add_argument(
        "--index", type=cli_args.nonneg_int, default=None, help="server/worker index (default: the task rank)"
    )
    ro.set_defaults(fn=_role)

    from agent_r1.records_cli import add_parser as add_records

    add_records(sub)
    return p


def _stdout_closed() -> bool:
    """True when standard output is a pipe whose reader has gone (``agent-r1 ... | head``)."""
    import select

    try:
        p = select.poll()
        p.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in p.poll(0))
    except (OSError, ValueError):
        return False


def main(argv: list[str] | None = None) -> int:
    # SIGPIPE stays ignored (Python's default): a server writing to a client that hung up must get
    # EPIPE as an exception, not die of the signal. A closed stdout pipe ends the command quietly.
    parser = build_parser()
    a, extra = parser.parse_known_args(argv)
    if extra and isinstance(getattr(a, "overrides", None), list) and all("=" in x for x in extra):
        a.overrides += extra  # Hydra overrides after an option: `train --print-config a=b`
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return a.fn(a)
    except BrokenPipeError:
        if not _stdout_closed():
            raise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 141  # as a shell reports a process ended by SIGPIPE (128 + 13)
    except Exception as e:  # the one error path: an expected failure is one line, a bug a traceback
        code = expected_failure(e)
        if code is None or a.debug:
            raise
        print(f"{command_name(a)}: {one_line(e)}", file=sys.stderr, flush=True)
        return code


def command_name(a: argparse.Namespace) -> str:
    """``agent-r1 records stats``: the words the user typed to pick the command."""
    words = [
        a.command,
        *(
            getattr(a, k, None)
            for k in ("records_command", "index_command", "env_command", "retriever_command")
        ),
    ]
    return " ".join(["agent-r1", *(w for w in words if w)])


if __name__ == "__main__":
    sys.exit(main())
