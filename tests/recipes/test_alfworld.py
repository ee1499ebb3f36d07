"""The alfworld recipe on the real engine (TextWorld's PddlEnv with upstream's wrappers): a
hand-written game folder in the official layout selected exactly as upstream's AlfredTWEnv selects
games, the offline generator (six task types, splits with held-out floor plans and objects,
deterministic), the planner expert's demonstrations winning through the agent, invalid commands,
and GiGPO's step groups on a replayed group."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest
from scripted import ScriptedPolicy

pytest.importorskip("alfworld")

from agent_r1.agent.flow import AGENTS, FlowConfig  # noqa: E402
from agent_r1.agent.tool_calls import format_tool_call  # noqa: E402
from agent_r1.agent.types import SamplingParams  # noqa: E402
from recipes import load_recipe  # noqa: E402

D = load_recipe("alfworld").data
from recipes.alfworld import games as G  # noqa: E402

SMALL = [12, 6, 6]  # offline games per split for these tests
FLOW = FlowConfig(
    max_steps=20, max_action_tokens=400, max_obs_tokens=8192, sampling=SamplingParams(max_new_tokens=400)
)


def _oid(name: str, x: int) -> str:
    return f"{name}_bar__plus_0{x}_dot_00_bar__plus_00_dot_90_bar__minus_01_dot_0{x}"


def _handwritten_game(
    folder: Path, solvable: object = True, task_type: str = "pick_cool_then_place_in_recep"
) -> None:
    """An ALFRED-style game as alfworld-download ships it: game.tw-pddl (domain, grammar with the
    task sentence, problem, solvable, walkthrough) and traj_data.json."""
    alf = G.alfworld_dir() / "data"
    apple, mug = _oid("Apple", 1), _oid("Mug", 2)
    fridge, counter, cabinet, table = (
        _oid(n, i) for i, n in enumerate(["Fridge", "CounterTop", "Cabinet", "DiningTable"], 3)
    )
    locs = {
        r: f"loc_bar__minus_{i}_bar_{i + 2}_bar_1_bar_45"
        for i, r in enumerate([fridge, counter, cabinet, table], 1)
    }
    start = "loc_bar__minus_9_bar_9_bar_0_bar_30"
    problem = f"""(define (problem plan_trial_T20190909_000000_000001)
(:domain alfred)
(:objects
agent1 - agent
AppleType MugType - otype
FridgeType CounterTopType CabinetType DiningTableType - rtype
{apple} {mug} - object
{fridge} {counter} {cabinet} {table} - receptacle
{start} {" ".join(locs.values())} - location
)
(:init
(atLocation agent1 {start})
(receptacleType {fridge} FridgeType) (receptacleType {counter} CounterTopType)
(receptacleType {cabinet} CabinetType) (receptacleType {table} DiningTableType)
{" ".join(f"(receptacleAtLocation {r} {loc})" for r, loc in locs.items())}
(openable {fridge}) (openable {cabinet})
(objectType {apple} AppleType) (objectType {mug} MugType)
(pickupable {apple}) (pickupable {mug}) (coolable {apple}) (heatable {apple}) (cleanable {mug})
(inReceptacle {apple} {table}) (objectAtLocation {apple} {locs[table]})
(inReceptacle {mug} {cabinet}) (objectAtLocation {mug} {locs[cabinet]})
{" ".join(f"(canContain {t} AppleType) (canContain {t} MugType)" for t in ["FridgeType", "CounterTopType", "CabinetType", "DiningTableType"])}
)
(:goal (and (exists (?r - receptacle) (exists (?o - object) (and (objectType ?o AppleType) (receptacleType ?r CounterTopType) (inReceptacle ?o ?r) (isCool ?o))))))
)
"""
    grammar = (alf / "alfred.twl2").read_text().replace("UNKNOWN GOAL", "put a cool apple in countertop")
    game = {"pddl_domain": (alf / "alfred.pddl").read_text(), "grammar": grammar, "pddl_problem": problem,
            "walkthrough": None}  # fmt: skip
    if solvable is not None:
        game["solvable"] = solvable
    folder.mkdir(parents=True)
    (folder / "game.tw-pddl").write_text(json.dumps(game))
    (folder / "initial_state.pddl").write_text(problem)
    traj = {"task_id": folder.name, "task_type": task_type,
            "pddl_params": {"object_target": "Apple", "parent_target": "CounterTop", "toggle_target": "",
                            "mrecep_target": "", "object_sliced": False},
            "turk_annotations": {"anns": [{"task_desc": "Put a cold apple on the counter.", "votes": [1, 1, 1]}]}}  # fmt: skip
    (folder / "traj_data.json").write_text(json.dumps(traj))


@pytest.fixture
def official(tmp_path):
    """One playable game and five that upstream's selection skips, in the download's layout."""
    split = tmp_path / "json_2.1.1" / "train"
    keep = split / "pick_cool_then_place_in_recep-Apple-None-CounterTop-1" / "trial_T20190909_000000_000001"
    _handwritten_game(keep)
    _handwritten_game(
        split / "pick_cool_then_place_in_recep-Apple-None-CounterTop-2" / "trial_T20190909_000000_000002",
        solvable=False,
    )
    _handwritten_game(
        split / "pick_cool_then_place_in_recep-Apple-None-CounterTop-3" / "trial_T20190909_000000_000003",
        solvable=None,
    )
    _handwritten_game(split / "pick_and_place_with_movable_recep-Apple-Bowl-CounterTop-4" / "trial_T20190909_000000_000004",
                      task_type="pick_and_place_with_movable_recep")  # fmt: skip
    _handwritten_game(
        split
        / "pick_cool_then_place_in_recep-AppleSliced-None-CounterTop-5"
        / "trial_T20190909_000000_000005"
    )
    missing = (
        split / "pick_cool_then_place_in_recep-Apple-None-CounterTop-6" / "trial_T20190909_000000_000006"
    )
    _handwritten_game(missing)
    (missing / "game.tw-pddl").unlink()
    return tmp_path, keep


def test_selection_equals_upstream_alfredtwenv(official):
    root, keep = official
    ours = [g.gamefile for g in G.collect_games(root, "train")]
    assert ours == [str(keep / "game.tw-pddl")]
    from alfworld.agents.environment.alfred_tw_env import AlfredTWEnv

    cfg = {"env": {"goal_desc_human_anns_prob": 0.0, "task_types": [1, 2, 3, 4, 5, 6]},
           "dataset": {"data_path": str(root / "json_2.1.1" / "train"), "num_train_games": -1}}  # fmt: skip
    assert sorted(AlfredTWEnv(cfg, train_eval="train").game_files) == ours
    g = G.collect_games(root, "train")[0]
    assert (g.task_type, g.goal, g.task_id) == (
        "pick_cool_then_place_in_recep",
        "put a cool apple in countertop",
        keep.name,
    )
    with pytest.raises(FileNotFoundError, match="valid_seen"):
        G.collect_games(root, "valid_seen")


@pytest.mark.parametrize(
    ("file", "damage", "says"),
    [
        ("game.tw-pddl", lambda t: t[: len(t) // 2], "game.tw-pddl: unreadable (Unterminated string"),
        ("game.tw-pddl", lambda t: json.dumps({**json.loads(t), "grammar": None}), "game.tw-pddl: 'grammar' must be a non-empty string"),
        ("game.tw-pddl", lambda t: json.dumps({k: v for k, v in json.loads(t).items() if k != "pddl_problem"}),
         "game.tw-pddl: 'pddl_problem' must be a non-empty string"),
        ("game.tw-pddl", lambda t: t.replace("Your task is to: ", "Your job: "), "'grammar' has no \"Your task is to: ...\" goal"),
        ("game.tw-pddl", lambda t: "[1, 2]", "game.tw-pddl: must be a JSON object, got list"),
        ("traj_data.json", lambda t: "{", "traj_data.json: unreadable"),
        ("traj_data.json", lambda t: json.dumps({**json.loads(t), "task_type": 3}), "traj_data.json: 'task_type' must be a string"),
    ],
)  # fmt: skip
def test_a_damaged_game_folder_names_the_file_and_key(official, file, damage, says):
    root, keep = official
    path = keep / file
    path.write_text(damage(path.read_text()))
    with pytest.raises(G.GameError) as e:
        G.collect_games(root, "train")
    assert str(path) in str(e.value) and says in str(e.value), str(e.value)


def test_official_game_won_by_the_planner_through_the_agent(official, codec):
    root, _ = official
    rows = D.build_rows("train", None, 0, data=str(root))
    assert len(rows) == 1 and rows[0].agent_name == "alfworld"
    demo = D.demonstrations(rows)[0]
    t = asyncio.run(
        AGENTS.get("alfworld").build(ScriptedPolicy(codec, demo), codec, FLOW).run(rows[0], "t", "g")
    )
    assert t.metrics["success"] == 1.0 and len(t.steps) == len(demo)
    assert [s.reward for s in t.steps] == [0.0] * (len(demo) - 1) + [1.0]
    first = codec.decode(t.steps[0].obs_token_ids)
    assert (
        "### Task\nput a cool apple in countertop\n### Current observation\nYou are in the middle of a room."
        in first
    )
    assert "- go to fridge 1" in first and "- help" not in first
    assert any("You cool the apple 1 using the fridge 1." in (s.feedback or "") for s in t.steps)


def test_generator_covers_task_types_and_holds_out_scenes_and_objects(tmp_path):
    counts = G.generate_games(tmp_path, seed=3, counts={"train": 12, "valid_seen": 6, "valid_unseen": 6})
    assert counts == {"train": 12, "valid_seen": 6, "valid_unseen": 6}
    summary = G.describe(tmp_path)
    assert set(summary["train"]) == set(G.TASK_TYPES.values()) and sum(summary["train"].values()) == 12
    assert set(summary["valid_unseen"]) == set(G.TASK_TYPES.values())

    def scenes_and_targets(split):
        out = set(), set()
        for g in G.collect_games(tmp_path, split):
            traj = json.loads((Path(g.gamefile).parent / "traj_data.json").read_text())
            out[0].add(traj["scene"]["scene_num"])
            out[1].add(traj["pddl_params"]["object_target"])
            game = json.loads(Path(g.gamefile).read_text())
            assert game["solvable"] is True and game["walkthrough"]
            assert re.fullmatch(r"trial_T\d{8}_\d{6}_\d{6}", Path(g.gamefile).parent.name)
            assert Path(g.gamefile).parent.parent.name.startswith(
                traj["task_type"] + "-" + traj["pddl_params"]["object_target"] + "-None-"
            )
        return out

    seen_scenes, seen_objs = scenes_and_targets("train")
    s2, o2 = scenes_and_targets("valid_seen")
    unseen_scenes, _ = scenes_and_targets("valid_unseen")
    seen_plans = {p for ps in G.ROOMS.values() for p in ps[:-1]}
    assert seen_scenes | s2 <= seen_plans and unseen_scenes <= {ps[-1] for ps in G.ROOMS.values()}
    assert not (seen_scenes | s2) & unseen_scenes
    assert not (seen_objs | o2) & G.UNSEEN_OBJECTS
    # seeded: the same games again, byte for byte
    again = tmp_path / "again"
    G.generate_games(again, seed=3, counts={"train": 3})
    first = sorted(p.relative_to(tmp_path) for p in (tmp_path / "json_2.1.1" / "train").rglob("*.tw-pddl"))
    second = sorted(p.relative_to(again) for p in (again / "json_2.1.1" / "train").rglob("*.tw-pddl"))
    assert set(second) <= set(first)
    for p in second:
        assert (again / p).read_bytes() == (tmp_path / p).read_bytes()


def _play(codec, row, script, tid="t"):
    return asyncio.run(
        AGENTS.get(row.agent_name).build(ScriptedPolicy(codec, script), codec, FLOW).run(row, tid, "g")
    )


@pytest.mark.parametrize("expert", ["planner", "handcoded"])
def test_expert_demonstrations_win_every_game_through_the_agent(codec, expert):
    for split in ("train", "valid_unseen"):
        rows = D.build_rows(split, None, 0, games=SMALL)
        assert len(rows) == SMALL[0 if split == "train" else 2]
        demos = D.demonstrations(rows, detour_rate=0.5, expert=expert)
        for i, (row, demo) in enumerate(zip(rows, demos, strict=True)):
            t = _play(codec, row, demo, f"t{i}")
            assert t.metrics["success"] == 1.0, (row.extra_info, demo)
            assert t.steps[-1].reward == 1.0 and all(s.reward == 0.0 for s in t.steps[:-1])
            assert all(c.get("error") is None for s in t.steps for c in s.info["tool_calls"])


def test_recovery_demonstrations_are_refused_masked_and_still_win(codec):
    """With misstep_rate the demonstrator first issues a command the game refuses (going where it
    stands, taking the task's object from where it is not, repeating itself) before some steps:
    replayed, the game refuses each, the next page shows the error, the misstep's action is
    masked (SFT does not imitate it), the expert's own steps are unchanged, and every game is won."""
    from types import SimpleNamespace

    from agent_r1.agent.demonstrations import Misstep
    from agent_r1.train.sft import demonstration_records

    rows = D.build_rows("train", None, 0, games=SMALL)
    opts = {"misstep_rate": 0.4, "expert": "handcoded", "max_steps": 20}
    scripts = D.demonstrations(rows, seed=3, **opts)
    plain = D.demonstrations(rows, expert="handcoded", max_steps=20)
    for script, expert in zip(scripts, plain, strict=True):
        assert [t for t in script if not isinstance(t, Misstep)] == expert
    wrong = [
        re.search(r'"command": "([^"]+)"', t).group(1) for s in scripts for t in s if isinstance(t, Misstep)
    ]
    assert len(wrong) >= 6
    assert {w.split()[0] for w in wrong} >= {"go", "take"}, wrong

    trajs = demonstration_records(D, rows, codec, FLOW, seed=3, **opts)
    masked = 0
    for t, script in zip(trajs, scripts, strict=True):
        assert t.metrics["success"] == 1.0 and len(t.steps) == len(script)
        for k, (s, turn) in enumerate(zip(t.steps, script, strict=True)):
            miss = isinstance(turn, Misstep)
            assert bool(s.info["tool_calls"][0].get("error")) == miss
            assert s.action_mask == [int(not miss)] * len(s.action_token_ids)
            if miss:
                masked += 1
                page = codec.decode(t.steps[k + 1].obs_token_ids)
                assert "### Error" in page and "is not an admissible command now" in page
    assert masked == len(wrong)

    # a misstep the game takes would leave the expert's later turns in another state: refused loudly
    first = plain[0]
    taken = SimpleNamespace(__name__="taken", demonstrations=lambda rows, seed: [[Misstep(first[0]), *first]])
    with pytest.raises(
        RuntimeError, match="1 demonstrated missteps were not refused; first, sft-p0-s0 step 0"
    ):
        demonstration_records(taken, rows[:1], codec, FLOW, seed=0)


def test_invalid_commands_leave_the_game_and_show(codec):
    row = D.build_rows("train", 1, 0, games=SMALL)[0]
    first = D.demonstrations([row])[0][0]
    script = [format_tool_call("env_step", {"command": "fly to the moon"}), "I am done.", first]
    flow = FlowConfig(
        max_steps=3, max_action_tokens=400, max_obs_tokens=8192, sampling=SamplingParams(max_new_tokens=400)
    )
    t = asyncio.run(
        AGENTS.get("alfworld").build(ScriptedPolicy(codec, script), codec, flow).run(row, "t", "g")
    )
    assert (
        len(t.steps) == 3 and t.steps[-1].done and t.steps[-1].reward == 0.0 and t.metrics["success"] == 0.0
    )
    assert [s.process_reward for s in t.steps] == [[None], [None], [None]]  # no penalty by default (upstream)
    second = codec.decode(t.steps[1].obs_token_ids)
    assert "'fly to the moon' is not an admissible command now; nothing happens" in second
    assert "### Actions so far" not in second  # the game did not move
    assert "call env_step with one of the admissible commands" in codec.decode(t.steps[2].obs_token_ids)
    assert t.steps[0].info["anchor_obs"] == t.steps[1].info["anchor_obs"] == t.steps[2].info["anchor_obs"]


def test_max_steps_is_capped_at_alfworlds_limit(codec):
    from agent_r1.agent.env import ENVS

    with pytest.raises(ValueError, match="max_steps must be in 1..50"):
        ENVS.get("alfworld")(codec, max_steps=60)


def test_gigpo_step_groups_are_non_trivial_on_a_replayed_group(codec):
    """The expert and a detouring demonstrator on one game share their first state, and meet
    again in the same states after the detour."""
    from agent_r1.learner.step_inputs import to_step_inputs
    from agent_r1.records.schema import records_to_table

    rows = D.build_rows("train", None, 0, games=SMALL)
    row = next(
        r
        for r in rows
        if len(D.demonstrations([r], seed=1, detour_rate=1.0)[0]) > len(D.demonstrations([r])[0])
    )
    a = _play(codec, row, D.demonstrations([row])[0], "a")
    b = _play(codec, row, D.demonstrations([row], seed=1, detour_rate=1.0)[0], "b")
    assert a.steps[0].info["anchor_obs"] == b.steps[0].info["anchor_obs"]
    batch = to_step_inputs(records_to_table(a.steps + b.steps), anchors=True)
    keys = batch.inputs.anchor_key.tolist()
    sizes = [keys.count(k) for k in set(keys)]
    assert max(sizes) == 2 and sum(s for s in sizes if s >= 2) >= 4


def test_a_pooled_game_starts_afresh_and_the_pool_is_bounded(codec):
    from recipes.alfworld.world import POOL, WorldPool

    row = D.build_rows("train", 1, 0, games=SMALL)[0]
    demo = D.demonstrations([row])[0]
    first = _play(codec, row, demo, "a")
    assert sum(len(v) for v in POOL.idle.values()) >= 1  # the game went back to the pool
    again = _play(codec, row, demo, "b")  # on the pooled game: the same episode, token for token
    assert [s.obs_token_ids for s in again.steps] == [s.obs_token_ids for s in first.steps]
    assert again.metrics["success"] == 1.0

    pool = WorldPool(size=2)
    worlds = [pool.take(D.gamefile(row.env_kwargs, row.extra_info)) for _ in range(3)]
    for w in worlds:
        pool.give(w)
    assert sum(len(v) for v in pool.idle.values()) == 2


def test_the_handcoded_expert_is_seeded_per_game():
    """Upstream's hand-coded expert draws from Python's global generator (two-object tasks):
    seeded by the game, the same plan every time, and the caller's generator is left alone."""
    import random

    rows = D.build_rows("train", None, 0, games=SMALL)
    two = [r for r in rows if r.extra_info["task_type"] == "pick_two_obj_and_place"]
    path = D.gamefile(two[0].env_kwargs, two[0].extra_info)
    random.seed(5)
    before = random.random()
    random.seed(5)
    plans = {D._handcoded_plan(path) for _ in range(3)}
    assert len(plans) == 1 and random.random() == before


def test_a_hung_engine_ends_the_episode_as_an_environment_error(codec, monkeypatch):
    """The engine steps on its own thread with a per-call limit: a command it does not answer in
    time ends the episode marked env_error (the rollout worker drops it), the game is not pooled
    again, other episodes' event loop never waited on it, and the next episode plays normally."""
    import dataclasses
    import threading
    import time

    from recipes.alfworld.world import POOL, World

    plain = D.build_rows("train", 1, 0, games=SMALL)[0]
    row = dataclasses.replace(plain, env_kwargs={**plain.env_kwargs, "step_timeout_s": 0.5})
    demo = D.demonstrations([plain])[0]
    release = threading.Event()
    real = World.step

    def hung(self, command):
        release.wait(30)  # an engine that does not answer
        return real(self, command)

    monkeypatch.setattr(World, "step", hung)
    ticks = []

    async def play_and_tick():
        async def tick():  # the event loop keeps running while the engine is stuck
            for _ in range(20):
                ticks.append(time.monotonic())
                await asyncio.sleep(0.02)

        flow = AGENTS.get(row.agent_name).build(ScriptedPolicy(codec, demo), codec, FLOW)
        t, _ = await asyncio.gather(flow.run(row, "hung", "g"), tick())
        return t

    pooled_before = sum(len(v) for v in POOL.idle.values())
    t = asyncio.run(play_and_tick())
    assert len(t.steps) == 1 and t.steps[0].done and t.metrics.get("env_error") == 1.0
    assert "did not answer" in t.steps[0].info["env_error"] and t.steps[0].reward == 0.0
    assert len(ticks) == 20 and max(b - a for a, b in zip(ticks, ticks[1:], strict=False)) < 0.4
    release.set()
    monkeypatch.setattr(World, "step", real)
    again = _play(codec, plain, demo, "after")  # the engine thread is free again
    assert again.metrics["success"] == 1.0 and "env_error" not in again.metrics
    assert sum(len(v) for v in POOL.idle.values()) <= pooled_before + 1  # the hung game was not pooled
