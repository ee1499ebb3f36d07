"""alfworld: a ToolEnv over one ALFWorld game on the real engine (``world.py``), its observation
rebuilt every step (the ``rewrite`` context mode): the task, the current observation, the numbered
actions so far and the admissible commands. One ``env_step(command)`` call per step.

A command that is not admissible leaves the game as it was and is answered with an error (the
engine itself would say ``Nothing happens.``); ``error_penalty`` (default 0, as upstream) can make
it cost. Reward 1.0 iff the game is won, at the terminal step; at most 20 steps (``max_steps``, up
to 50 as ALFWorld allows). Each step records its state as ``info.anchor_obs`` (the observation and
the admissible commands), so GiGPO groups the steps of a group's trajectories that stand in the
same state.

The engine is synchronous: each command runs on the process's one engine thread (the event loop,
and with it every other episode of the worker, goes on meanwhile), with ``step_timeout_s`` per
call. An engine that fails or does not answer in time ends the episode marked ``env_error`` (the
rollout worker counts and drops it, as for a dead WebShop site) and its game is discarded, never
pooled again.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from agent_r1.agent.context import Turn
from agent_r1.agent.env import ENVS
from agent_r1.agent.flow import AGENTS, AgentEnvLoop, AgentSpec
from agent_r1.agent.tool_env import ToolEnv
from agent_r1.agent.types import Action, Observation, StepResult
from agent_r1.agent_tools import TOOLS, ToolError, ToolOutput
from agent_r1.agent_tools.env_step import EnvStepTool
from recipes.alfworld.data import AGENT, MAX_RECEPTACLES, SYSTEM, gamefile
from recipes.alfworld.data import TOOLS as RECIPE_TOOLS
from recipes.alfworld.world import POOL, State, World, render_page, split_intro

MAX_STEPS_CAP = 50  # ALFWorld's own episode limit
# one thread: the engines of a process never step concurrently (as before: TextWorld and the
# planner keep module-level state), and a hung step holds this thread only
_ENGINE = ThreadPoolExecutor(max_workers=1, thread_name_prefix="alfworld-engine")
LOAD_TIMEOUT_S = 120.0  # a game load (~0.25 s) waits this long for the engine thread at most


@TOOLS.register("alfworld_env_step")
class AlfworldEnvStep(EnvStepTool):
    description = "Do one thing in the household: one of the admissible commands, exactly as listed."
    example = "e.g. go to fridge 1, take apple 1 from countertop 2, cool apple 1 with fridge 1"


@ENVS.register("alfworld")
class AlfWorldEnv(ToolEnv):
    CHAT_CONTINUES = False

    def __init__(self, codec: Any, data: str | None = None, games_seed: int = 0, games: list[int] | None = None,
                 max_receptacles: int = MAX_RECEPTACLES, step_timeout_s: float = 60.0, **kwargs: Any):  # fmt: skip
        kwargs.setdefault("tools", list(RECIPE_TOOLS))
        kwargs.setdefault("max_steps", 20)
        kwargs.setdefault("max_calls_per_step", 1)
        kwargs.setdefault("system_prompt", SYSTEM)
        if not 1 <= kwargs["max_steps"] <= MAX_STEPS_CAP:
            raise ValueError(f"alfworld: max_steps must be in 1..{MAX_STEPS_CAP}, got {kwargs['max_steps']}")
        if not step_timeout_s > 0:
            raise ValueError(f"alfworld: step_timeout_s must be > 0, got {step_timeout_s}")
        # the env_step call's own limit must not cut the engine's short: this env ends the episode
        kwargs.setdefault("tool_timeout_s", step_timeout_s + 5.0)
        super().__init__(codec, context="rewrite", **kwargs)
        self.where = {
            "data": data,
            "games_seed": games_seed,
            "games": games,
            "max_receptacles": max_receptacles,
        }
        self.tools["env_step"].env = self
        self.step_timeout_s = step_timeout_s
        self.world: World | None = None
        self.state: State | None = None
        self.task, self.room = "", ""
        self.actions: list[str] = []
        self.error: str | None = None

    def reset(self, prompt: list[dict[str, Any]] | None = None, **row: Any) -> Observation:
        extra = row.get("extra_info") or {}
        if "game" not in extra:
            raise ValueError("alfworld: the row's extra_info names no game")
        self.start_history(prompt)
        old, path = self.world, gamefile(self.where, extra)

        def load() -> tuple[World, State]:  # on the engine thread, like every use of a game
            if old is not None:
                POOL.give(old)
            world = POOL.take(path)
            return world, world.reset()

        self.world = None
        limit = max(self.step_timeout_s, LOAD_TIMEOUT_S)
        try:  # reset is synchronous (ToolEnv's interface): wait here, as the load always did
            self.world, self.state = _ENGINE.submit(load).result(timeout=limit)
        except TimeoutError:  # the engine thread is stuck: the worker fails and is restarted
            raise RuntimeError(
                f"alfworld: the game engine did not load {path} within {limit:g} s (is an earlier step hung?)"
            ) from None
        self.room, self.task = split_intro(self.state.feedback)
        self.actions, self.error, self.num_steps = [], None, 0
        self._render()
        return self.context.observation(self.history)

    def render_text(self) -> str:
        observation = self.room if not self.actions else None
        return render_page(self.state, self.task, self.actions, self.error, observation)

    def _render(self) -> None:
        text = self.render_text()
        self.history.turns = [Turn("user", self.codec.encode_message("user", text), text)]

    def anchor(self) -> str:
        return "\n".join([self.room if not self.actions else self.state.feedback, *self.state.admissible])

    async def env_step(self, command: str) -> ToolOutput:
        command = " ".join(command.strip().split())
        if command not in self.state.admissible:
            raise ToolError(f"'{command}' is not an admissible command now; nothing happens")
        step = asyncio.get_running_loop().run_in_executor(_ENGINE, self.world.step, command)
        hung = f"the game engine did not answer '{command}' within {self.step_timeout_s:g} s"
        try:
            self.state = await asyncio.wait_for(step, self.step_timeout_s)
        except asyncio.CancelledError:  # the call's own limit cut it short: as hung
            self._lose_world(hung)
            raise
        except Exception as e:  # noqa: BLE001 - hung (TimeoutError) or failed: the game is unusable
            self._lose_world(
                hung if isinstance(e, TimeoutError) else f"the game engine failed on '{command}': {e!r}"
            )
            raise ToolError(self.env_error) from None
        self.actions.append(command)
        return ToolOutput(self.state.feedback, None, {"won": self.state.won})

    def _lose_world(self, why: str) -> None:
        """The engine broke under this episode: the game is dropped (its step may still be running
        on the engine thread) and ToolEnv ends the episode as an environment error."""
        self.env_error, self.world = why, None

    async def step(self, action: Action) -> StepResult:
        anchor = self.anchor()
        res = await super().step(action)
        res.info["anchor_obs"] = anchor
        if self.env_error is not None:  # ended by ToolEnv: not scored, not trained on
            return res
        if self.state.won:
            res.observation, res.done, res.reward = None, True, 1.0
            res.info["reward"] = {"correct": True, "metrics": {"steps_to_win": len(self.actions)}}
        elif res.done:  # out of steps, or cut (ToolEnv's penalty)
            res.reward = res.reward or 0.0
            res.info["reward"] = {"correct": False}
        return res

    async def observe(self, outputs: list[ToolOutput], feedback: str) -> None:
        errors = [o.result for o in outputs if o.info.get("error")]
        self.error = errors[-1] if errors else None
        self._render()

    async def close(self) -> None:
        if self.world is not None:  # back to the pool, after any step of it still queued
            given = asyncio.wrap_future(_ENGINE.submit(POOL.give, self.world))
            self.world = None
            try:
                await asyncio.wait_for(given, self.step_timeout_s)
            except TimeoutError:  # the engine is stuck elsewhere: the game goes back when it frees
                pass
        await super().close()

    def answer_allowed(self) -> bool:
        return False  # the episode ends when the game is won (or at max_steps)

    def missing_call_message(self) -> str:
        return "call env_step with one of the admissible commands"


if AGENT not in AGENTS:
    AGENTS.register(AGENT)(AgentSpec(AgentEnvLoop, {"env": "alfworld"}))
