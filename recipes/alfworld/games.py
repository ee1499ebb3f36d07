"""ALFWorld games on disk: the official layout, its selection rules, and an offline generator.

Layout (as ``alfworld-download`` fills ``$ALFWORLD_DATA``)::

    ROOT/json_2.1.1/{train,valid_seen,valid_unseen}/
        <task_type>-<Object>-<MovableRecep or None>-<Receptacle or toggle>-<scene_num>/
            trial_T<YYYYMMDD>_<HHMMSS>_<micro>/
                traj_data.json  initial_state.pddl  game.tw-pddl

``collect_games`` keeps a trial folder exactly when upstream's ``AlfredTWEnv.collect_game_files``
does: it has ``traj_data.json``, its path names neither ``movable`` nor ``Sliced``, the task type is
selected, ``game.tw-pddl`` exists and says ``"solvable": true``.

``generate_games`` writes ALFRED-style games in that layout without downloads: the rooms are
ALFRED's own scenes (the receptacles and object classes of the THOR floor plans shipped in the
``alfworld`` package, cut to a few receptacles), the goals and task sentences are
``alfworld.gen.goal_library``'s, object properties and what fits where are
``alfworld.gen.constants``'. Every game is played by the engine's planner expert before it is
written; its plan is the game's ``walkthrough`` (unsolved games are not written). ``valid_unseen``
uses held-out floor plans and held-out object classes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent_r1.errors import AgentR1Error

TASK_TYPES = {
    1: "pick_and_place_simple",
    2: "look_at_obj_in_light",
    3: "pick_clean_then_place_in_recep",
    4: "pick_heat_then_place_in_recep",
    5: "pick_cool_then_place_in_recep",
    6: "pick_two_obj_and_place",
}
SPLITS = ("train", "valid_seen", "valid_unseen")
VERSION = "json_2.1.1"

# floor plans by room (ALFRED numbering); valid_unseen uses the last of each (ALFRED's own unseen
# scenes are 10, 219, 308 and 424)
ROOMS = {
    "Kitchen": [1, 2, 3, 5, 10],
    "LivingRoom": [201, 203, 205, 209, 219],
    "Bedroom": [301, 302, 304, 305, 308],
    "Bathroom": [401, 402, 403, 405, 424],
}
# target object classes never used in train / valid_seen (they appear in valid_unseen only)
UNSEEN_OBJECTS = frozenset({"Tomato", "Cup", "CD", "Pencil", "SprayBottle", "Watch"})
LAMP_HOLDERS = ("Desk", "SideTable", "Dresser", "Nightstand", "CoffeeTable", "DiningTable", "Shelf")
NEEDS = {"clean": "SinkBasin", "heat": "Microwave", "cool": "Fridge"}
ACTION_CLASS = {"clean": "Cleanable", "heat": "Heatable", "cool": "Coolable"}


def alfworld_dir() -> Path:
    spec = importlib.util.find_spec("alfworld")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(
            "the alfworld recipe needs the alfworld package: pip install -e '.[alfworld]' (make install does)"
        )
    return Path(spec.origin).parent


def data_root(data: str | None = None) -> Path | None:
    """The user's ALFWorld games: ``data`` (must exist), else ``$ALFWORLD_DATA`` when it holds the
    downloaded games (importing alfworld sets that variable to ``~/.cache/alfworld`` whether or not
    anything was downloaded); None: use the offline games."""
    if data:
        root = Path(os.path.expandvars(os.path.expanduser(data)))
        if not root.is_dir():
            raise FileNotFoundError(f"alfworld: recipe.options.data={data}: no such folder")
        return root
    env = os.environ.get("ALFWORLD_DATA")
    if env and (Path(os.path.expandvars(os.path.expanduser(env))) / VERSION).is_dir():
        return Path(os.path.expandvars(os.path.expanduser(env)))
    return None


# ---- reading the official layout -------------------------------------------------------------
@dataclass(frozen=True)
class GameInfo:
    gamefile: str  # path of game.tw-pddl
    task_type: str
    task_id: str
    goal: str  # the task sentence as the game states it


def split_dir(root: Path, split: str) -> Path:
    if split not in SPLITS:
        raise ValueError(f"alfworld: unknown split {split!r}; known: {list(SPLITS)}")
    for cand in (root / VERSION / split, root / split):
        if cand.is_dir():
            return cand
    raise FileNotFoundError(
        f"alfworld: no {split} games under {root} (expected {root / VERSION / split}, as alfworld-download "
        "writes it)"
    )


def goal_sentence(grammar: str) -> str:
    """The task sentence of a game's grammar (``Your task is to: ...`` in its intro)."""
    marker = "Your task is to: "
    i = grammar.find(marker)
    if i < 0:
        return ""
    return grammar[i + len(marker) :].split('"', 1)[0].split("\\n", 1)[0].strip().rstrip(".")


class GameError(AgentR1Error, ValueError):
    """An ALFWorld game folder's file is unreadable or lacks what the game needs; names file and key."""


def _json_object(path: Path) -> dict[str, Any]:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise GameError(f"alfworld: {path}: unreadable ({e})") from None
    if not isinstance(obj, dict):
        raise GameError(f"alfworld: {path}: must be a JSON object, got {type(obj).__name__}")
    return obj


def collect_games(root: Path, split: str, task_types: list[int] | None = None) -> list[GameInfo]:
    """The solvable games of a split, with upstream's selection rules, in a stable order."""
    wanted = {TASK_TYPES[t] for t in (task_types or list(TASK_TYPES))}
    games = []
    for folder, _, files in os.walk(split_dir(root, split), topdown=False):
        if "traj_data.json" not in files or "movable" in folder or "Sliced" in folder:
            continue
        game_path, traj_path = Path(folder) / "game.tw-pddl", Path(folder) / "traj_data.json"
        traj = _json_object(traj_path)
        if not isinstance(traj.get("task_type"), str):
            raise GameError(
                f"alfworld: {traj_path}: 'task_type' must be a string, got {traj.get('task_type')!r}"
            )
        if traj["task_type"] not in wanted or not game_path.exists():
            continue
        game = _json_object(game_path)
        if not game.get("solvable"):  # a missing key is skipped upstream too
            continue
        for key in ("pddl_domain", "pddl_problem", "grammar"):
            if not isinstance(game.get(key), str) or not game[key].strip():
                raise GameError(
                    f"alfworld: {game_path}: {key!r} must be a non-empty string (the game cannot load)"
                )
        goal = goal_sentence(game["grammar"])
        if not goal:
            raise GameError(f"alfworld: {game_path}: 'grammar' has no \"Your task is to: ...\" goal sentence")
        task_id = traj.get("task_id") or Path(folder).name
        games.append(GameInfo(str(game_path), traj["task_type"], str(task_id), goal))
    return sorted(games, key=lambda g: g.gamefile)


# ---- the offline generator -----------------------------------------------------------------------
def thor_name(text: str) -> str:
    """A THOR id as ALFWorld's PDDL writes it (``Mug|+01.00|...`` -> ``Mug_bar__plus_01_dot_00...``)."""
    for a, b in (("|", "_bar_"), ("-", "_minus_"), ("+", "_plus_"), (".", "_dot_"), (",", "_comma_")):
        text = text.replace(a, b)
    return text


def _loc(pos: list[float]) -> str:
    x, z, rot, hor = (int(round(v * 4)) if i < 2 else int(v) for i, v in enumerate(pos))
    return thor_name(f"loc|{x}|{z}|{rot}|{hor}")


class _Facts:
    """What ALFWorld's generator knows about classes (from the installed package)."""

    def __init__(self) -> None:
        from alfworld.gen import constants as c
        from alfworld.gen import goal_library as g

        self.fits: dict[str, set[str]] = {k: set(v) for k, v in c.VAL_RECEPTACLE_OBJECTS.items()}
        self.actions: dict[str, set[str]] = {k: set(v) for k, v in c.VAL_ACTION_OBJECTS.items()}
        self.openable = set(c.OPENABLE_CLASS_LIST)
        self.receptacles = set(c.RECEPTACLES) | {"SinkBasin", "BathtubBasin"}
        lamps = self.actions["Toggleable"]
        self.pickupable = {
            o for v in self.fits.values() for o in v if "Sliced" not in o and o not in lamps
        } - self.receptacles
        self.goals = g.gdict
        self.valid_rooms = c.GOALS_VALID


def _scene(plan: int) -> tuple[dict[str, list[float]], list[str]]:
    layouts = alfworld_dir() / "gen" / "layouts"
    recs = json.loads((layouts / f"FloorPlan{plan}-openable.json").read_text())
    objs = json.loads((layouts / f"FloorPlan{plan}-objects.json").read_text())
    return recs, objs


def rclass(rid: str) -> str:
    """A receptacle's class: ``Sink|x|y|z|SinkBasin`` is a SinkBasin (the demangler calls it
    ``sinkbasin``), ``Cabinet|x|y|z`` a Cabinet."""
    parts = rid.split("|")
    return parts[-1] if parts[-1].endswith("Basin") else parts[0]


def _sentence(facts: _Facts, task: str, obj: str, recep: str, toggle: str, rng: random.Random) -> str:
    template = rng.choice(facts.goals[task]["templates"])
    return template.format(obj=obj.lower(), recep=recep.lower(), toggle=toggle.lower())


def _choose(facts: _Facts, task: str, plan: int, split: str, rng: random.Random, max_receptacles: int):
    """Receptacles, objects (class, receptacle id) and the task's targets for one game, or None."""
    recs, classes = _scene(plan)
    by_class: dict[str, list[str]] = {}
    for rid in sorted(recs):
        by_class.setdefault(rclass(rid), []).append(rid)
    allowed = (lambda o: True) if split == "valid_unseen" else (lambda o: o not in UNSEEN_OBJECTS)
    present = sorted(o for o in set(classes) if o in facts.pickupable and allowed(o))
    kind = next((k for k in NEEDS if k in task), None)
    keep: list[str] = []
    toggle = ""
    if kind:
        if NEEDS[kind] not in by_class:
            return None
        keep.append(rng.choice(by_class[NEEDS[kind]]))
        present = [o for o in present if o in facts.actions[ACTION_CLASS[kind]]]
    if task == "look_at_obj_in_light":
        lamps = [c for c in ("DeskLamp", "FloorLamp") if c in classes]
        holders = [r for c in LAMP_HOLDERS for r in by_class.get(c, [])]
        if not lamps or not holders:
            return None
        toggle, lamp_at = rng.choice(lamps), rng.choice(holders)
        keep.append(lamp_at)
    parents = [c for c in by_class if c not in NEEDS.values() or task == "pick_and_place_simple"]
    cands = [(o, p) for o in present for p in parents if o in facts.fits.get(p, ())]
    if task == "look_at_obj_in_light":
        cands = [(o, "") for o in present]
    if not cands:
        return None
    obj, parent = rng.choice(sorted(set(cands)))
    if parent:
        keep.append(rng.choice(by_class[parent]))
    # the object(s) start somewhere else that can hold them
    n_targets = 2 if task == "pick_two_obj_and_place" else 1
    homes = [r for r in sorted(recs) if obj in facts.fits.get(rclass(r), ()) and rclass(r) != parent]
    if not homes:
        return None
    rest = [r for r in sorted(recs) if r not in keep]
    rng.shuffle(rest)
    chosen = list(dict.fromkeys(keep))
    starts = [rng.choice(homes) for _ in range(n_targets)]
    for r in starts + rest:
        if len(chosen) >= max_receptacles and r not in starts:
            break
        if r not in chosen:
            chosen.append(r)
    placed = [(obj, s) for s in starts]
    if toggle:
        placed.append((toggle, lamp_at))
    others = [o for o in present if o != obj]
    rng.shuffle(others)
    for o in others[: rng.randint(2, 4)]:
        fits = [r for r in chosen if o in facts.fits.get(rclass(r), ())]
        if fits:
            placed.append((o, rng.choice(fits)))
    return {r: recs[r] for r in chosen}, placed, obj, parent, toggle


def problem_text(name: str, recs: dict[str, list[float]], placed: list[tuple[str, str]], goal: str,
                 facts: _Facts, rng: random.Random) -> str:  # fmt: skip
    """An ALFRED PDDL problem (``initial_state.pddl``) with the goal's ``#`` written as ``-``."""
    start = thor_name(f"loc|{rng.randint(-12, 12)}|{rng.randint(-12, 12)}|{rng.choice([0, 90, 180, 270])}|30")
    rids = {r: thor_name(r) for r in recs}
    oids: list[tuple[str, str, str]] = []
    for cls, rec in placed:
        oid = ""
        while not oid or any(oid == o for o, _, _ in oids):
            oid = thor_name(f"{cls}|" + "|".join(f"{rng.uniform(-3, 3):+06.2f}" for _ in range(3)))
        oids.append((oid, cls, rec))
    rtypes = sorted({rclass(r) for r in recs} | set(NEEDS.values()))
    otypes = sorted({c for _, c, _ in oids} | {"Knife", "ButterKnife"})
    locs = sorted({_loc(p) for p in recs.values()} | {start})
    init = [f"(atLocation agent1 {start})"]
    for r, pos in recs.items():
        cls = rclass(r)
        init += [f"(receptacleType {rids[r]} {cls}Type)", f"(receptacleAtLocation {rids[r]} {_loc(pos)})"]
        if cls in facts.openable:
            init.append(f"(openable {rids[r]})")
    lamps = facts.actions["Toggleable"]
    flags = {
        "Heatable": "heatable",
        "Coolable": "coolable",
        "Cleanable": "cleanable",
        "Sliceable": "sliceable",
    }
    for oid, cls, rec in oids:
        init += [f"(objectType {oid} {cls}Type)", f"(inReceptacle {oid} {rids[rec]})",
                 f"(objectAtLocation {oid} {_loc(recs[rec])})"]  # fmt: skip
        if cls in lamps:
            init.append(f"(toggleable {oid})")
        else:
            init += [f"(pickupable {oid})", f"(moveable {oid})"]
        init += [f"({flag} {oid})" for k, flag in flags.items() if cls in facts.actions[k]]
    for rt in rtypes:
        init += [f"(canContain {rt}Type {ot}Type)" for ot in otypes if ot in facts.fits.get(rt, ())]
    return "\n".join([
        f"(define (problem {name})", "(:domain alfred)", "(:objects", "agent1 - agent",
        " ".join(f"{t}Type" for t in otypes) + " - otype",
        " ".join(f"{t}Type" for t in rtypes) + " - rtype",
        " ".join(o for o, _, _ in oids) + " - object",
        " ".join(rids.values()) + " - receptacle",
        " ".join(locs) + " - location", ")",
        "(:init", *init, ")",
        goal.replace("#", "-").strip(),
    ])  # fmt: skip


def plan_of(gamefile: str, max_steps: int = 50) -> list[str] | None:
    """The planner expert's winning commands for a game, or None when it does not win."""
    from recipes.alfworld.world import World

    world = World(gamefile, expert="planner")
    state = world.reset()
    plan: list[str] = []
    while not state.won and len(plan) < max_steps:
        if not state.expert_plan:
            return None
        plan.append(state.expert_plan[0])
        state = world.step(plan[-1])
    return plan if state.won else None


def generate_games(root: Path, seed: int = 0, counts: dict[str, int] | None = None,
                   max_receptacles: int = 4, task_types: list[int] | None = None) -> dict[str, int]:  # fmt: skip
    """Write ``counts[split]`` solvable games per split under ``root/json_2.1.1`` (the task types
    in turn, seeded); returns how many were written."""
    facts = _Facts()
    domain = (alfworld_dir() / "data" / "alfred.pddl").read_text()
    grammar = (alfworld_dir() / "data" / "alfred.twl2").read_text()
    counts = counts or {"train": 120, "valid_seen": 24, "valid_unseen": 24}
    types = [TASK_TYPES[t] for t in (task_types or list(TASK_TYPES))]
    written = {}
    for split in SPLITS:
        rng = random.Random(f"{seed}-{split}")
        n, tries = 0, 0
        while n < counts.get(split, 0):
            tries += 1
            if tries > 50 * counts[split] + 100:
                raise RuntimeError(f"alfworld generator: only {n} solvable {split} games in {tries} tries")
            task = types[n % len(types)]
            rooms = sorted(facts.valid_rooms[task])
            room = rng.choice(rooms)
            plans = ROOMS[room][-1:] if split == "valid_unseen" else ROOMS[room][:-1]
            plan = rng.choice(plans)
            chosen = _choose(facts, task, plan, split, rng, max_receptacles)
            if chosen is None:
                continue
            recs, placed, obj, parent, toggle = chosen
            stamp = (
                f"T2026{rng.randint(101, 1231):04d}_{rng.randint(0, 235959):06d}_{rng.randint(0, 999999):06d}"
            )
            task_id = f"trial_{stamp}"
            target = toggle or parent
            folder = root / VERSION / split / f"{task}-{obj}-None-{target}-{plan}" / task_id
            sentence = _sentence(facts, task, obj, parent, toggle, rng)
            goal = facts.goals[task]["pddl"].format(obj=obj, recep=parent, toggle=toggle)
            problem = problem_text(f"plan_{task_id}", recs, placed, goal, facts, rng)
            traj = {
                "task_id": task_id,
                "task_type": task,
                "pddl_params": {
                    "object_target": obj,
                    "parent_target": parent,
                    "toggle_target": toggle,
                    "mrecep_target": "",
                    "object_sliced": False,
                },  # fmt: skip
                "scene": {
                    "floor_plan": f"FloorPlan{plan}",
                    "scene_num": plan,
                    "random_seed": rng.randrange(1 << 30),
                },
                "turk_annotations": {
                    "anns": [
                        {
                            "task_desc": sentence[0].upper() + sentence[1:] + ".",
                            "high_descs": [],
                            "votes": [1, 1, 1],
                        }
                    ]
                },  # fmt: skip
            }
            game = {"pddl_domain": domain, "grammar": grammar.replace("UNKNOWN GOAL", sentence),
                    "pddl_problem": problem, "solvable": False, "walkthrough": None}  # fmt: skip
            tmp = folder.with_name(folder.name + ".tmp")
            tmp.mkdir(parents=True, exist_ok=True)
            (tmp / "traj_data.json").write_text(json.dumps(traj, indent=1))
            (tmp / "initial_state.pddl").write_text(problem)
            (tmp / "game.tw-pddl").write_text(json.dumps(game))
            walkthrough = plan_of(str(tmp / "game.tw-pddl"))
            if walkthrough is None or folder.exists():
                shutil.rmtree(tmp)
                continue
            game.update(solvable=True, walkthrough=walkthrough)
            (tmp / "game.tw-pddl").write_text(json.dumps(game))
            tmp.rename(folder)
            n += 1
        written[split] = n
    return written


def offline_root(seed: int = 0, counts: dict[str, int] | None = None, max_receptacles: int = 4) -> Path:
    """The offline games for ``seed`` (generated once into the temp dir, then reused)."""
    import hashlib
    import tempfile

    key = json.dumps([seed, counts, max_receptacles, sorted(UNSEEN_OBJECTS), ROOMS, 1], sort_keys=True)
    folder = Path(tempfile.gettempdir()) / f"agent_r1_alfworld_{hashlib.sha1(key.encode()).hexdigest()[:12]}"
    if not (folder / VERSION).exists():
        tmp = folder.with_name(folder.name + f".tmp{random.randrange(1 << 30)}")
        generate_games(tmp, seed, counts, max_receptacles)
        try:
            tmp.replace(folder)
        except OSError:  # another process wrote it first
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def describe(root: Path) -> dict[str, Any]:
    """Games per split and task type (for the README and tests)."""
    out: dict[str, Any] = {}
    for split in SPLITS:
        try:
            games = collect_games(root, split)
        except FileNotFoundError:
            continue
        by: dict[str, int] = {}
        for g in games:
            by[g.task_type] = by.get(g.task_type, 0) + 1
        out[split] = by
    return out
