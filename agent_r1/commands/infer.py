"""``agent-r1 infer``: batch inference — prompts or data rows in, one JSON line per episode out.

Input (``--input``): a parquet of data rows (``agent-r1 data`` writes them), or JSON lines / a JSON
list whose records are data rows (they have ``agent_name``) or open prompts: ``{"prompt": "text"}``
or ``{"messages": [...]}``, optionally with ``"ground_truth"`` and an ``"id"``. An open prompt runs
as the recipe's agent (``--recipe``: its agent, tools, system prompt and reward style; scored when
it has a ground truth), as a tool agent (``--tools calculator,search``), or as one answer.

Output (``--out answers.jsonl``): per episode ``{"index", "id", "sample", "answer", "steps",
"tool_calls", "tool_errors", "truncated", "reward", "success"}`` (``reward``/``success`` null when
unscored). Written a chunk at a time; a second run with the same ``--out`` skips what is there
(resume after a crash or Ctrl-C). Episodes run concurrently over every server given
(``--url`` repeated) or started (``--servers N`` embedded engines).
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

from agent_r1.errors import UsageError

log = logging.getLogger("agent_r1.infer")


def open_prompt_template(recipe: str | None, tools: list[str] | None) -> Any:
    """The data row an open prompt becomes (its ``prompt``: the system message to put first)."""
    from agent_r1.data.rows import DataRow

    if recipe:
        from recipes import load_recipe

        t = load_recipe(recipe).build_rows(split="test", num=1, seed=0)[0]
        system = [m for m in t.prompt[:1] if m["role"] == "system"]
        return DataRow(system, t.agent_name, dict(t.reward_model), f"infer:{recipe}", dict(t.env_kwargs))
    unscored = {"style": "unscored", "ground_truth": ""}
    if tools:
        return DataRow([], "tool_agent", unscored, "infer", {"tools": tools})
    return DataRow([], "single_step", unscored, "infer")


def read_inputs(path: str | Path, recipe: str | None = None, tools: list[str] | None = None) -> list[Any]:
    """Data rows of ``path`` (see the module doc); errors name the file and row."""
    return [row for _, row in located_inputs(path, recipe, tools)]


def _ground_truth_ok(x: Any) -> bool:
    if isinstance(x, list):
        return all(_ground_truth_ok(v) for v in x)
    return isinstance(x, str | int) or (isinstance(x, float) and math.isfinite(x))


def located_inputs(
    path: str | Path, recipe: str | None = None, tools: list[str] | None = None
) -> list[tuple[str, Any]]:
    """``(where, data row)`` of every record of ``path``: ``where`` is ``file:line`` or ``file row n``."""
    from agent_r1.agent.flow import AGENTS
    from agent_r1.data.rows import DataRow, RowError, load_rows, validate_row
    from agent_r1.jsonfiles import iter_records

    path = Path(path)
    if path.suffix == ".parquet":
        return [(f"{path} row {n}", r) for n, r in enumerate(load_rows(path, AGENTS))]
    template = open_prompt_template(recipe, tools)
    out = []
    for where, rec in iter_records(path, RowError, "input file"):
        if not isinstance(rec, dict):
            raise RowError(f"{where}: a record must be a JSON object")
        if "agent_name" in rec:
            row = validate_row(rec, where)
            if row.agent_name not in AGENTS:
                raise RowError(f"{where}: unknown agent {row.agent_name!r}; known: {AGENTS.names()}")
            out.append((where, row))
            continue
        if isinstance(rec.get("prompt"), str) and rec["prompt"].strip():
            messages = [{"role": "user", "content": rec["prompt"]}]
        elif isinstance(rec.get("messages"), list) and rec["messages"]:
            messages = rec["messages"]
            for i, m in enumerate(messages):
                if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in (
                    "system", "user", "assistant"
                ):  # fmt: skip
                    raise RowError(
                        f"{where}: messages[{i}] needs a role (system/user/assistant) and string content"
                    )
        else:
            raise RowError(f"{where}: needs a non-empty 'prompt' string, 'messages', or a data row's keys")
        if messages[0]["role"] != "system":
            messages = template.prompt + messages
        if not _ground_truth_ok(rec.get("ground_truth", "")):
            raise RowError(
                f"{where}: ground_truth must be a string, a finite number or a list of them,"
                f" got {rec['ground_truth']!r}"
            )
        reward = dict(template.reward_model)
        if rec.get("ground_truth") is not None and reward["style"] != "unscored":
            reward["ground_truth"] = rec["ground_truth"]
        else:
            reward = {"style": "unscored", "ground_truth": ""}
        extra = {"id": rec["id"]} if "id" in rec else {}
        row = DataRow(
            messages, template.agent_name, reward, template.data_source, dict(template.env_kwargs), extra
        )
        out.append((where, row))
    if not out:
        raise RowError(f"{path}: no records")
    return out


def check_fits(located: list[tuple[str, Any]], codec: Any, max_obs_tokens: int) -> None:
    """Refuse, before any server starts, a prompt that cannot fit the observation budget: a token
    covers at most ``codec.max_token_chars`` characters, so a prompt of ``c`` characters is at least
    ``c // max_token_chars`` tokens (a bound, no tokenizing: a 50 MB line is refused at once)."""
    from agent_r1.agent.chat import content_text
    from agent_r1.data.rows import RowError

    for where, row in located:
        chars = sum(len(content_text(m.get("content", ""))) for m in row.prompt)
        at_least = chars // codec.max_token_chars
        if at_least > max_obs_tokens:
            raise RowError(
                f"{where}: the prompt ({chars} characters, at least {at_least} tokens) cannot fit"
                f" --max-obs-tokens {max_obs_tokens}"
            )


def episode_line(index: int, row: Any, traj: Any, codec: Any) -> dict[str, Any]:
    base = {
        "index": index,
        "id": row.extra_info.get("id", index),
        "sample": int(traj.trajectory_id.rsplit("-s", 1)[1]),
    }
    if not traj.steps:  # the first observation did not fit the budget: nothing was generated
        return {**base, "answer": None, "steps": 0, "tool_calls": [], "tool_errors": 0, "truncated": True,
                "reward": None, "success": None, "error": "the prompt is longer than --max-obs-tokens"}  # fmt: skip
    last = traj.steps[-1]
    calls = [c for s in traj.steps for c in s.info.get("tool_calls", [])]
    scored = row.reward_model.get("style") != "unscored"
    return {
        **base,
        "answer": codec.decode_action(last.action_token_ids),
        "steps": len(traj.steps),
        "tool_calls": [{k: c.get(k) for k in ("name", "error") if c.get(k) is not None} for c in calls],
        "tool_errors": sum(1 for c in calls if c.get("error")),
        "truncated": bool(last.truncated),
        "reward": traj.metrics.get("reward") if scored else None,
        "success": bool(traj.metrics.get("success")) if scored else None,
    }


def done_indices(out: Path, n: int) -> set[int]:
    """Rows whose ``n`` samples are all in ``out`` already (a torn last line is dropped)."""
    if not out.exists():
        return set()
    counts: dict[int, int] = {}
    good: list[str] = []
    for line in out.read_text(encoding="utf-8").splitlines():
        try:
            counts[json.loads(line)["index"]] = counts.get(json.loads(line)["index"], 0) + 1
            good.append(line)
        except (ValueError, KeyError, TypeError):
            continue
    done = {i for i, c in counts.items() if c >= n}
    # keep only whole rows, so a row cut in half runs again from its first sample
    kept = [x for x in good if json.loads(x)["index"] in done]
    out.write_text("".join(x + "\n" for x in kept), encoding="utf-8")
    return done


def parse_tools(text: str | None) -> list[str] | None:
    """``--tools calculator,search``: the names, each checked against the tool registry."""
    if not text:
        return None
    from agent_r1.agent_tools import TOOLS

    tools = [t.strip() for t in text.split(",")]
    unknown = [t for t in tools if t not in TOOLS]
    if unknown:
        raise UsageError(f"--tools: no tool named {unknown[0]!r}; known: {', '.join(TOOLS.names())}")
    return tools


def add_parser(sub: Any) -> None:
    from agent_r1 import cli_args
    from agent_r1.commands.flags import add_episode_flags, add_policy_flags
    from recipes import RECIPES

    inf = sub.add_parser("infer", help="batch inference: prompts or data rows -> episodes -> JSON lines")
    inf.add_argument(
        "--input", required=True, help="rows.parquet, or JSON lines / a JSON list of prompts or rows"
    )
    inf.add_argument("--out", required=True, help="answers.jsonl (resumed when it exists)")
    add_policy_flags(inf, many_urls=True)
    inf.add_argument(
        "--servers", type=cli_args.positive_int, default=1, help="embedded servers to start (without --url)"
    )
    inf.add_argument(
        "--recipe", default=None, choices=RECIPES, help="open prompts run as this recipe's agent"
    )
    inf.add_argument("--tools", default=None, help="open prompts run as a tool agent: calculator,search")
    inf.add_argument("--index", default=None, help="the search tools' index")
    inf.add_argument("--n", type=cli_args.positive_int, default=1, help="samples per prompt")
    add_episode_flags(inf)
    inf.add_argument(
        "--chunk", type=cli_args.positive_int, default=64, help="prompts per written chunk (the resume unit)"
    )
    inf.add_argument("--concurrency", type=cli_args.positive_int, default=64, help="episodes in flight")
    inf.add_argument("--no-progress", action="store_true")
    inf.set_defaults(fn=run)


def run(a: Any) -> int:
    from agent_r1.logging import setup_logging

    setup_logging("infer")
    m = run_infer(a)
    ok = "" if m["success"] is None else f"; success {m['success']:.3f} over {m['scored']} scored episodes"
    print(
        f"infer: {m['episodes']} episodes of {m['prompts']} prompts ({m['new_prompts']} new, "
        f"{m['wall_seconds']:.1f} s){ok}\nanswers: {a.out}",
        flush=True,
    )
    return 0


def run_infer(a: Any) -> dict[str, Any]:
    from agent_r1.commands.policy_source import resolve_policy, serving
    from recipes import load_all

    load_all()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    located = located_inputs(a.input, a.recipe, parse_tools(a.tools))
    rows = [row for _, row in located]
    policy = resolve_policy(a, out.parent / f"{out.stem}.models")
    check_fits(located, policy.codec, policy.episode.max_obs_tokens)  # a prompt too long starts nothing
    done = done_indices(out, a.n)
    todo = [i for i in range(len(rows)) if i not in done]
    if done:
        log.info("resuming: %d of %d prompts already in %s", len(done), len(rows), out)
    t0 = time.time()
    with serving(policy, a, servers=a.servers):
        for start in range(0, len(todo), a.chunk):
            idx = todo[start : start + a.chunk]
            trajs = policy.run_episodes(
                [rows[i] for i in idx], a.n, id_prefix="infer", max_concurrency=a.concurrency,
                progress=not a.no_progress,
            )  # fmt: skip
            lines = [
                episode_line(idx[k // a.n], rows[idx[k // a.n]], t, policy.codec) for k, t in enumerate(trajs)
            ]
            with out.open("a", encoding="utf-8") as f:
                f.writelines(json.dumps(x, ensure_ascii=False) + "\n" for x in lines)
            log.info("%d / %d prompts done", len(done) + start + len(idx), len(rows))
    lines = [json.loads(x) for x in out.read_text(encoding="utf-8").splitlines()]
    scored = [x for x in lines if x["success"] is not None]
    return {
        "prompts": len(rows),
        "episodes": len(lines),
        "new_prompts": len(todo),
        "scored": len(scored),
        "success": sum(x["success"] for x in scored) / len(scored) if scored else None,
        "wall_seconds": round(time.time() - t0, 2),
    }
