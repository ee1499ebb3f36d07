"""Pre-flight: everything about a run that can be known before any process starts.

Config keys check their own values when the config is built (``config.py``); what depends on the
model, the hardware or the data is checked here, once, by the launcher: the layout against the
model's layers and heads, the precision against this machine, the context length against the
prompts, and every data row (agent, environment options, reward style) as the rollout would use
it. All problems are reported together, each naming its key, file or row.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import time
from pathlib import Path
from typing import Any

from agent_r1.rollout.served import helper_models
from agent_r1.train.config import ConfigError, TrainConfig

log = logging.getLogger("agent_r1.preflight")

ROWS_CHECKED = 5000  # per split: enough to catch a bad generator or file without reading a corpus twice
# per split: first observations are checked (each one an environment reset: an ALFWorld game loads in
# ~0.3 s, 3553 official training games would take 18 min) until this many seconds are spent
RESET_BUDGET_S = 15.0


def model_dims(cfg: TrainConfig) -> dict[str, int] | None:
    """Layers, heads, KV heads and FFN width of the model the run will use (its ``config.json``, or
    the tiny model the preset builds); None when there is no model to read."""
    path = Path(cfg.model.path)
    if (path / "config.json").exists():
        hf = json.loads((path / "config.json").read_text())
        heads = hf.get("num_attention_heads", 0)
        return {
            "layers": hf.get("num_hidden_layers", 0),
            "heads": heads,
            "kv_heads": hf.get("num_key_value_heads") or heads,
            "ffn": hf.get("intermediate_size", 0),
            "positions": hf.get("max_position_embeddings", 0),
            "experts": hf.get("num_experts") or hf.get("num_local_experts") or 0,
            "vision": int("vision_config" in hf),
        }
    b = cfg.model.build
    if b is None:
        return None
    experts = 8 if b.arch == "qwen3_moe" else 0  # agent_r1.models.tiny's MoE
    return {
        "layers": b.layers,
        "heads": b.heads,
        "kv_heads": b.kv_heads,
        "ffn": 0,
        "positions": 0,
        "experts": experts,
        "vision": int(b.arch in ("qwen2_vl", "qwen2_5_vl")),
    }


def model_problems(cfg: TrainConfig, local: bool = True) -> list[str]:
    """The model path, the parallel layout against the model, the precision against this machine
    (``local``: the run's processes start here; a Slurm login node is not the compute nodes)."""
    out: list[str] = []
    m, par = cfg.model, cfg.parallel
    path = Path(m.path)
    if not (path / "config.json").exists():
        if m.build is None:
            out.append(f"model.path: {path} has no config.json (not a HuggingFace model folder: a typo?)")
        elif path.resolve() != Path(m.build.at).resolve():
            out.append(
                f"model.path: {path} does not exist, and the preset builds its tiny model only at "
                f"model.build.at={m.build.at}: fix the path, or set model.build.at={path} to build there"
            )
    for name, hpath in helper_models(cfg).items():
        if not (Path(hpath) / "config.json").exists() and not (
            m.build is not None and Path(hpath).resolve() == Path(m.build.at).resolve()
        ):
            key = "algorithm.teacher" if name == "teacher" else f"rollout.helpers.{name}"
            out.append(f"{key}: {hpath} has no config.json (not a HuggingFace model folder)")
    dims = model_dims(cfg)
    if dims:
        stages = par.pp * par.vpp
        if stages > 1 and dims["layers"] % stages:
            out.append(
                f"parallel.pp={par.pp}"
                + (f" x parallel.vpp={par.vpp}" if par.vpp > 1 else "")
                + f": the model's {dims['layers']} layers do not split evenly into {stages} pipeline stages"
            )
        for key, what in (
            ("heads", "attention heads"),
            ("kv_heads", "key-value heads"),
            ("ffn", "FFN width"),
        ):
            if dims[key] and dims[key] % par.tp:
                out.append(f"parallel.tp={par.tp} does not divide the model's {dims[key]} {what}")
        if par.ep > 1 and not dims["experts"]:
            out.append(f"parallel.ep={par.ep}: the model is dense (no experts to spread); use parallel.ep=1")
        elif dims["experts"] % par.ep:
            out.append(f"parallel.ep={par.ep} does not divide the model's {dims['experts']} experts")
        if dims["experts"] and par.tp > 1 and not par.sp:
            out.append(
                f"parallel.tp={par.tp} with a mixture-of-experts model needs parallel.sp=true "
                "(Megatron-Core's MoE layer takes the sequence-parallel token split at TP > 1)"
            )
        if par.cp > 1 and dims.get("vision"):
            out.append(
                f"parallel.cp={par.cp}: context parallelism splits sequences by 1-D positions; a "
                "vision-language model's multimodal positions need parallel.cp=1"
            )
        if dims["experts"] and par.tp > 1 and par.ep == 1:
            out.append(
                f"parallel.tp={par.tp} with a mixture-of-experts model needs parallel.ep > 1 (at EP 1 "
                "Megatron-Core never sums the experts' gradients over the TP ranks): e.g. parallel.ep=tp"
            )
        if dims["positions"] and m.max_len > dims["positions"]:
            out.append(
                f"model.max_len={m.max_len} exceeds the model's max_position_embeddings={dims['positions']}"
            )
    e = cfg.episode
    if e.context_len > m.max_len:
        out.append(
            f"episode.max_obs_tokens={e.max_obs_tokens} + episode.max_action_tokens={e.max_action_tokens}"
            f" = {e.context_len} must fit model.max_len={m.max_len} (the servers'"
            " context: an observation at its budget leaves no room for a full action): lower one or raise"
            " model.max_len"
        )
    if local:
        import torch

        if m.precision == "fp8" and not (
            torch.cuda.is_available() and importlib.util.find_spec("transformer_engine")
        ):
            out.append(
                "model.precision=fp8 needs NVIDIA GPUs with Transformer Engine; this machine has "
                f"{'no CUDA device' if not torch.cuda.is_available() else 'no transformer_engine'}"
            )
    return out


def data_problems(cfg: TrainConfig, rd: Any = None) -> list[str]:
    """Every data row of both splits (up to ``ROWS_CHECKED``) as the rollout would use it: its
    agent, its reward style and ground truth, and (for ``RESET_BUDGET_S`` per split) its
    environment built with its options and reset, and its first observation against the token
    budget. Needs the model's tokenizer. ``rd``: the run directory, whose served models (policy,
    helpers) environments may name."""

    from agent_r1.agent.chat import ChatCodec
    from agent_r1.data.rows import RowError
    from agent_r1.train.splits import shared_file_problems, split_rows

    r = cfg.recipe
    from agent_r1.train.run_services import run_services

    try:
        services = run_services(cfg, rd, pending=True)  # nothing is asked before the run starts
    except ValueError as e:
        return [str(e)]
    codec = ChatCodec.load(cfg.model.path)
    flow_cfg = cfg.episode.flow()
    out: list[str] = shared_file_problems(cfg)
    for split in ("train", "test"):
        try:
            rows = split_rows(cfg, split)[:ROWS_CHECKED]
        except RowError as e:  # too few rows, a malformed file: named by the loader
            out.append(str(e))
            continue
        except (TypeError, ValueError, KeyError, OSError) as e:
            out.append(
                f"recipe {r.name} ({split} split, recipe.options={r.options}): {type(e).__name__}: {e}"
            )
            continue
        out += asyncio.run(_check_rows(rows, split, codec, flow_cfg, services=services))
    return out


async def _check_rows(
    rows: list[Any],
    split: str,
    codec: Any,
    flow_cfg: Any,
    reset_budget_s: float = RESET_BUDGET_S,
    services: Any = None,
) -> list[str]:
    from agent_r1.agent.flow import AGENTS
    from agent_r1.rewards import REWARDS, compute_reward

    out: list[str] = []
    over = reset = 0
    t0 = time.monotonic()
    for i, row in enumerate(rows):
        where = f"{split} row {i}"
        if row.agent_name not in AGENTS:
            out.append(f"{where}: agent_name {row.agent_name!r} is not a registered agent {AGENTS.names()}")
            continue
        style = row.reward_model.get("style")
        if style not in REWARDS:
            out.append(f"{where}: reward_model.style {style!r} is not a registered reward {REWARDS.names()}")
        else:
            try:
                compute_reward(row.reward_model, "")
            except (TypeError, ValueError, KeyError) as e:
                out.append(f"{where}: reward_model {row.reward_model}: {type(e).__name__}: {e}")
        if time.monotonic() - t0 <= reset_budget_s:
            reset += 1
            try:
                flow = AGENTS.get(row.agent_name).build(None, codec, flow_cfg, services)
                ids = await flow.first_observation(row)
                over += len(ids) > flow_cfg.max_obs_tokens
            except (TypeError, ValueError, KeyError) as e:
                out.append(f"{where}: env_kwargs {row.env_kwargs}: {type(e).__name__}: {e}")
        if len(out) >= 10:
            out.append("(further rows not checked)")
            return out
    if reset < len(rows):
        log.info(
            "%s split: first observations of %d of %d rows checked in %.0f s (environment resets); "
            "the others are reset when they are played",
            split,
            reset,
            len(rows),
            reset_budget_s,
        )
    if reset and over == reset:
        out.append(
            f"{split} split: every first observation is longer than episode.max_obs_tokens="
            f"{flow_cfg.max_obs_tokens}: nothing could be generated (raise it, and model.max_len)"
        )
    elif over:
        log.warning(
            "%s split: %d of %d first observations exceed episode.max_obs_tokens=%d and will end at once",
            split,
            over,
            reset,
            flow_cfg.max_obs_tokens,
        )
    return out


def retrieval_problems(cfg: TrainConfig) -> list[str]:
    """A recipe whose tools search needs an index it has or can build."""
    from agent_r1.retrieval.index import build_hint, read_meta
    from recipes import load_recipe

    recipe = load_recipe(cfg.recipe.name)
    r = cfg.retrieval
    if not r.index:
        if "search" in recipe.tools:
            return [f"recipe {cfg.recipe.name} searches: set retrieval.index=DIR (built when missing)"]
        return []
    meta = read_meta(r.index)
    if meta is None and not r.build:
        return [f"retrieval.index={r.index} does not exist and retrieval.build=false; {build_hint(r.index)}"]
    if meta is None and recipe.passages is None:
        return [
            f"retrieval.index={r.index} does not exist and recipe {cfg.recipe.name} has no passages to build it from; {build_hint(r.index)}"
        ]
    if meta is not None and r.dense and not meta.get("dense") and not r.build:
        return [
            f"retrieval.index={r.index} has no dense index (retrieval.dense=true); rebuild it with --dense"
        ]
    return []


def raise_problems(problems: list[str]) -> None:
    if problems:
        raise ConfigError("the run cannot start:\n  - " + "\n  - ".join(problems))
