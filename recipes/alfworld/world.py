"""One ALFWorld game on the real engine: TextWorld's ``PddlEnv`` with the wrappers upstream's
``AlfredTWEnv`` puts around it (``AlfredDemangler`` without shuffling, ``AlfredInfos``, and
``AlfredExpert`` when an expert is asked for), stepped one command at a time."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class State:
    feedback: str  # what the engine answered (the intro with the task at reset)
    admissible: list[str]  # commands whose preconditions hold now (without ``help``)
    won: bool
    expert_plan: list[str] = field(default_factory=list)


class World:
    def __init__(self, gamefile: str, expert: str | None = None):
        import textworld
        from alfworld.agents.environment.alfred_tw_env import (
            AlfredDemangler,
            AlfredExpert,
            AlfredInfos,
        )
        from textworld.envs import PddlEnv

        infos = textworld.EnvInfos(won=True, admissible_commands=True, extras=["gamefile"])
        env = AlfredInfos(AlfredDemangler(PddlEnv(infos), shuffle=False))
        if expert:
            infos.extras.append("expert_plan")
            env = AlfredExpert(env, expert_type=expert)
        env.load(gamefile)
        self.env, self.gamefile, self.expert = env, gamefile, expert

    def _state(self, st) -> State:
        admissible = [c for c in (st["admissible_commands"] or []) if c != "help"]
        plan = list(st.get("extra.expert_plan") or []) if self.expert else []
        return State(st.feedback.strip(), admissible, bool(st["won"]), plan)

    def reset(self) -> State:
        return self._state(self.env.reset())

    def step(self, command: str) -> State:
        st, _, _ = self.env.step(command)
        return self._state(st)

    def close(self) -> None:
        self.env.close()


class WorldPool:
    """Loaded games kept for the next episode of the same game: ``reset`` restores a game's
    initial state, so a group's samples (and later groups) skip parsing its grammar and problem
    again (2/3 of an episode's engine time). At most ``size`` idle games, the oldest closed first."""

    def __init__(self, size: int = 128):
        self.size, self.idle = size, OrderedDict()  # gamefile -> [World, ...]

    def take(self, gamefile: str) -> World:
        free = self.idle.get(gamefile)
        if free:
            world = free.pop()
            if not free:
                del self.idle[gamefile]
            return world
        return World(gamefile)

    def give(self, world: World) -> None:
        self.idle.setdefault(world.gamefile, []).append(world)
        self.idle.move_to_end(world.gamefile)
        while sum(len(v) for v in self.idle.values()) > self.size:
            _, oldest = next(iter(self.idle.items()))
            oldest.pop(0).close()
            if not oldest:
                self.idle.popitem(last=False)


POOL = WorldPool()


def split_intro(text: str) -> tuple[str, str]:
    """The reset text's room description and task (``... Your task is to: put a mug in shelf.``)."""
    body = text.split("-= Welcome to TextWorld, ALFRED! =-", 1)[-1].strip()
    room, _, task = body.rpartition("Your task is to: ")
    return room.strip(), task.strip().rstrip(".")


def render_page(state: State, task: str, actions: list[str], error: str | None = None,
                observation: str | None = None) -> str:  # fmt: skip
    """The observation text: task, current observation, numbered actions, admissible commands."""
    lines = ["### Task", task, "### Current observation", observation or state.feedback]
    if actions:
        lines += ["### Actions so far", *(f"[{i}] {a}" for i, a in enumerate(actions, 1))]
    if error:
        lines += ["### Error", error]
    lines += ["### Admissible commands", *(f"- {c}" for c in state.admissible)]
    return "\n".join(lines)
