"""alfworld: household tasks in ALFWorld's text engine (TextWorld + the ALFRED PDDL domain). One
row per game; the environment (``env.py``) plays it on the real engine and scores 1.0 iff the game
is won. Games: the official ALFWorld folders (``recipe.options.data=DIR`` or ``$ALFWORLD_DATA``,
as ``alfworld-download`` fills it) or the seeded offline games (``games.py``) in the same layout.

Splits: ``train``; the trainer's ``test`` is ``options.test_split`` (``valid_seen`` by default;
``valid_unseen`` holds out floor plans and object classes); ``agent-r1 eval --split valid_unseen``
picks either directly.
"""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path
from typing import Any

from agent_r1.agent.demonstrations import Misstep
from agent_r1.agent.tool_calls import format_tool_call
from agent_r1.data.rows import DataRow
from recipes.alfworld.games import SPLITS, TASK_TYPES, collect_games, data_root, offline_root

AGENT = "alfworld"
TOOLS = ["alfworld_env_step"]
SYSTEM = (
    "You are an agent in a household. Each step, call env_step with exactly one of the admissible "
    "commands to reach the task's goal: go to places, open them, take and move objects, and heat, "
    "cool, clean or use things."
)
OFFLINE_COUNTS = {"train": 120, "valid_seen": 24, "valid_unseen": 24}
MAX_RECEPTACLES = 4  # offline rooms: ALFRED's floor plans cut to this many receptacles


@functools.lru_cache(maxsize=8)
def games_root(data: str | None = None, games_seed: int = 0, games: tuple[int, int, int] | None = None,
               max_receptacles: int = MAX_RECEPTACLES) -> Path:  # fmt: skip
    """The folder with ``json_2.1.1/<split>/...``: the user's data, or the offline games."""
    root = data_root(data)
    if root is not None:
        return root
    counts = dict(zip(OFFLINE_COUNTS, games, strict=True)) if games else OFFLINE_COUNTS
    return offline_root(games_seed, counts, max_receptacles)


def _split(split: str, test_split: str) -> str:
    return test_split if split == "test" else split


def build_rows(split: str = "train", num: int | None = None, seed: int = 0, data: str | None = None,
               test_split: str = "valid_seen", task_types: list[int] | None = None,
               games: list[int] | None = None, games_seed: int = 0,
               max_receptacles: int = MAX_RECEPTACLES) -> list[DataRow]:  # fmt: skip
    """One row per game of the split (upstream's selection), shuffled with ``seed``. The offline
    games are generated with ``games_seed`` (``games``: how many per split; ``max_receptacles``:
    room size), so runs with other seeds play the same games."""
    if _split(split, test_split) not in SPLITS:  # before any game is generated
        raise ValueError(f"alfworld: unknown split {_split(split, test_split)!r}; known: {list(SPLITS)}")
    where = {
        "data": data,
        "games_seed": games_seed,
        "games": list(games) if games else None,
        "max_receptacles": max_receptacles,
    }
    root = games_root(data, games_seed, tuple(games) if games else None, max_receptacles)
    found = collect_games(root, _split(split, test_split), task_types)
    random.Random(f"alfworld-{seed}-{split}").shuffle(found)
    rows = []
    for g in found[:num]:
        rel = str(Path(g.gamefile).relative_to(root))
        rows.append(
            DataRow(
                prompt=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": g.goal}],
                agent_name=AGENT,
                reward_model={"style": "env_scored", "ground_truth": g.task_type},
                data_source="alfworld",
                env_kwargs=where,
                extra_info={
                    "split": _split(split, test_split),
                    "game": rel,
                    "task_type": g.task_type,
                    "task_id": g.task_id,
                },  # fmt: skip
            )
        )
    return rows


def gamefile(row_env: dict[str, Any], extra: dict[str, Any]) -> str:
    games = row_env.get("games")
    root = games_root(row_env.get("data"), row_env.get("games_seed", 0), tuple(games) if games else None,
                      row_env.get("max_receptacles", MAX_RECEPTACLES))  # fmt: skip
    return str(root / extra["game"])


@functools.lru_cache(maxsize=4096)
def expert_plan(path: str, expert: str = "planner", max_steps: int = 20) -> tuple[str, ...]:
    """A winning command list for a game. ``planner``: the game's walkthrough (the generator
    writes the planner's plan there), else the planner expert's plan; it knows where everything
    is. ``handcoded``: upstream's hand-coded expert (its default), which knows only what it has
    seen and searches receptacles one by one; seeded by the game's path, and the planner's plan
    where it does not win within ``max_steps`` (it can lose two-object tasks)."""
    from recipes.alfworld.games import plan_of

    if expert == "handcoded":
        plan = _handcoded_plan(path, max_steps)
        if plan:
            return plan
    elif expert != "planner":
        raise ValueError(f"alfworld: unknown expert {expert!r} (planner | handcoded)")
    walk = json.loads(Path(path).read_text()).get("walkthrough")
    plan = walk or plan_of(path)
    if not plan:
        raise ValueError(f"alfworld: the planner expert does not win {path}")
    return tuple(plan)


def _handcoded_plan(path: str, max_steps: int = 20) -> tuple[str, ...] | None:
    from recipes.alfworld.world import World

    saved = random.getstate()
    random.seed(path)  # the hand-coded expert draws from the global generator
    try:
        world = World(path, expert="handcoded")
        state, plan = world.reset(), []
        while not state.won and state.expert_plan and len(plan) < max_steps:
            if state.expert_plan[0] not in state.admissible:  # e.g. "help" when it is stuck
                break
            plan.append(state.expert_plan[0])
            state = world.step(plan[-1])
        world.close()
    finally:
        random.setstate(saved)
    return tuple(plan) if state.won else None


def demonstrations(rows: list[DataRow], seed: int = 0, detour_rate: float = 0.0, misstep_rate: float = 0.0,
                   expert: str = "planner", max_steps: int = 20) -> list[list[str]]:  # fmt: skip
    """The expert's commands (``planner`` or ``handcoded``, see ``expert_plan``) as env_step calls,
    at most ``max_steps`` of them (set it to the run's ``episode.max_steps``). With
    ``detour_rate`` a noisy demonstrator: that often, before one of its ``go to`` steps, it first
    goes somewhere else the room offers (checked on the engine: the rest of the plan still wins
    from there; only where the plan has a step to spare). With ``misstep_rate``, recovery
    demonstrations: before that share of its steps (where the plan has steps to spare) it first
    issues a command the game refuses, as a learning policy does (``_misstep``); the turn is a
    ``Misstep`` (replayed, not imitated), so the demonstration shows the refusal and the move on."""
    if not 0.0 <= misstep_rate <= 1.0:
        raise ValueError(f"alfworld: misstep_rate must be in [0, 1], got {misstep_rate}")
    rng = random.Random(seed)
    out = []
    for row in rows:
        path = gamefile(row.env_kwargs, row.extra_info)
        plan = list(expert_plan(path, expert, max_steps))
        gotos = [i for i, c in enumerate(plan) if c.startswith("go to ")]
        if gotos and rng.random() < detour_rate and len(plan) < max_steps:
            plan = _with_detour(path, plan, rng.choice(gotos), rng)
        if misstep_rate > 0 and len(plan) < max_steps:
            plan = _with_missteps(path, plan, misstep_rate, max_steps, rng)
        out.append([_env_step_call(c) for c in plan])
    return out


def _env_step_call(command: str) -> str:
    """The env_step call of ``command`` (a ``Misstep``'s call is one too)."""
    call = format_tool_call("env_step", {"command": command})
    return Misstep(call) if isinstance(command, Misstep) else call


def _misstep(state: Any, plan: list[str], k: int, rng: random.Random) -> str | None:
    """A command the game refuses before plan step ``k``, of the kinds a learning policy issues
    (README, ALFWorld: where the refusals come from): going to the place it stands at, taking the
    task's object from where it is not, or repeating the previous command. None if none is refused."""
    here = next((c[len("go to ") :] for c in reversed(plan[:k]) if c.startswith("go to ")), None)
    obj = next((c.split()[1:3] for c in plan[k:] if c.startswith("take ")), None)
    wrong = []
    if here is not None:
        wrong.append(f"go to {here}")
        if obj is not None:
            wrong.append(f"take {' '.join(obj)} from {here}")
    if k > 0:
        wrong.append(plan[k - 1])
    wrong = [c for c in dict.fromkeys(wrong) if c not in state.admissible]
    return rng.choice(wrong) if wrong else None


def _with_missteps(path: str, plan: list[str], rate: float, max_steps: int, rng: random.Random) -> list[str]:
    """``plan`` with a ``Misstep`` (``_misstep``) before each step with probability ``rate``, as
    long as the plan still fits in ``max_steps``; the engine says which commands it refuses."""
    from recipes.alfworld.world import POOL

    world, out = POOL.take(path), []
    try:
        state = world.reset()
        for k, command in enumerate(plan):
            if len(out) + len(plan) - k < max_steps and rng.random() < rate:
                wrong = _misstep(state, plan, k, rng)
                if wrong is not None:
                    out.append(Misstep(wrong))
            out.append(command)
            state = world.step(command)
        return out
    finally:
        POOL.give(world)


def _with_detour(path: str, plan: list[str], k: int, rng: random.Random) -> list[str]:
    """``plan`` with a ``go to`` to another place inserted before step ``k``, when the engine
    says the result still wins; else ``plan`` as it was."""
    from recipes.alfworld.world import POOL

    world = POOL.take(path)
    try:
        state = world.reset()
        for c in plan[:k]:
            state = world.step(c)
        others = [c for c in state.admissible if c.startswith("go to ") and c != plan[k]]
        if not others:
            return plan
        detour = rng.choice(others)
        state = world.step(detour)
        for c in plan[k:]:
            if c not in state.admissible:
                return plan
            state = world.step(c)
        return plan[:k] + [detour] + plan[k:] if state.won else plan
    finally:
        POOL.give(world)


def corpus(num: int = 48, seed: int = 0) -> list[str]:
    """Tokenizer texts: the pages of up to ``num`` offline games per split along their
    walkthroughs, the commands and the demonstrations' calls."""
    from agent_r1.agent.chat import render_message, render_system
    from agent_r1.agent_tools import TOOLS as REGISTRY
    from recipes.alfworld.world import World, render_page

    root = games_root(None, seed)
    texts: list[str] = []
    for split in ("train", "valid_seen", "valid_unseen"):
        for g in collect_games(root, split)[: num or None]:
            world = World(g.gamefile)
            state = world.reset()
            actions: list[str] = []
            texts.append(render_page(state, g.goal, actions))
            for c in expert_plan(g.gamefile):
                state = world.step(c)
                actions.append(c)
                texts.append(render_page(state, g.goal, actions))
                texts.append(format_tool_call("env_step", {"command": c}))
            world.close()
    schemas = [REGISTRY.get(t)().schema for t in TOOLS]
    texts += [render_message("system", render_system(SYSTEM, schemas))] * 20
    return texts


__all__ = ["TASK_TYPES", "build_rows", "demonstrations", "corpus"]
