"""webshop: a ToolEnv over the WebShop site (``shop.py``), its observation rebuilt every step
(the ``rewrite`` context mode): the instruction, the current page, the last actions and the
available actions. One ``env_step(command)`` call per step with ``search[...]`` or ``click[...]``.

Rewards per step: +10 when a purchase scores 1.0 (WebShop's success), -0.1 for an invalid action
or a reply without one call, else 0 (``score_reward`` adds that times the purchase's score: a
shaped reward for small models; off by default); the purchase's score in [0, 1] is logged (``rollout/score``,
``eval/score``). At most 15 steps. Each step records its page (``info.anchor_obs``) so GiGPO groups
the steps of a group's trajectories that stand on the same page.

The site runs in this process, or on the run's WebShop environment server (``server="run"``: the
launcher's ``env_webshop`` role; or a URL). A server that stays unreachable ends the episode with
``info.env_error``: the rollout worker counts and drops it, so it is never trained on.
"""

from __future__ import annotations

from typing import Any

from agent_r1.agent.context import Turn
from agent_r1.agent.env import ENVS
from agent_r1.agent.flow import AGENTS, AgentEnvLoop, AgentSpec
from agent_r1.agent.tool_env import ToolEnv
from agent_r1.agent.types import Action, Observation, StepResult
from agent_r1.agent_tools import TOOLS, ToolError, ToolOutput
from agent_r1.agent_tools.env_step import EnvStepTool
from agent_r1.agent_tools.services import Services
from recipes.webshop.catalog import Goal
from recipes.webshop.data import AGENT, PRODUCTS_PER_KIND, SYSTEM, shop_for
from recipes.webshop.sessions import EnvServerError, LocalSession, RemoteSession

SUCCESS_REWARD, INVALID_PENALTY = 10.0, 0.1


def server_url(server: str | None, services: Services) -> tuple[str | None, str | None]:
    """(the site's address, its API key): None for the site in this process (``server`` unset or
    ``local``), the run's environment server for ``run`` (its current address: a restarted server
    may move), else ``server`` itself."""
    if server in (None, "", "local"):
        return None, None
    if server == "run":
        if services.env_server is None:
            raise ValueError("webshop: server=run, but this episode was given no environment server of a run")
        return services.env_server.current(), services.env_server.api_key
    return server, None


@TOOLS.register("env_step")
class EnvStep(EnvStepTool):
    description = "Take one action on the shopping site: search[keywords] or click[target]."
    example = "e.g. search[red mug] or click[buy now]"


@ENVS.register("webshop")
class WebShopEnv(ToolEnv):
    CHAT_CONTINUES = False

    def __init__(self, codec: Any, data: str | None = None, seed: int = 0, human: bool = False,
                 products: int = PRODUCTS_PER_KIND, keep_actions: int = 3, server: str | None = None, score_reward: float = 0.0,
                 **kwargs: Any):  # fmt: skip
        kwargs.setdefault("tools", ["env_step"])
        kwargs.setdefault("max_steps", 15)
        kwargs.setdefault("max_calls_per_step", 1)
        kwargs.setdefault("error_penalty", INVALID_PENALTY)
        kwargs.setdefault("system_prompt", SYSTEM)
        super().__init__(codec, context="rewrite", **kwargs)
        self.where = (data, seed, human, products)
        server_url(server, self.services)  # a bad option fails here; each episode asks for the address
        self.server = server
        self.tools["env_step"].env = self
        self.keep_actions = keep_actions
        self.score_reward = (
            score_reward  # shaping: this times the purchase's score, on top of +10 for success
        )
        self.session: LocalSession | RemoteSession | None = None
        self.actions: list[str] = []
        self.errors: list[str] = []

    def reset(self, prompt: list[dict[str, Any]] | None = None, **row: Any) -> Observation:
        goal = (row.get("extra_info") or {}).get("goal")
        if not isinstance(goal, dict):
            raise ValueError("webshop: the row's extra_info has no goal")
        self.start_history(prompt)
        url, api_key = server_url(self.server, self.services)
        if url is not None:
            self.session = RemoteSession(url, Goal(**goal), api_key)
        else:
            self.session = LocalSession(shop_for(*self.where), Goal(**goal))
        self.actions, self.errors = [], []
        self.num_steps = 0
        self._render()
        return self.context.observation(self.history)

    def render_text(self) -> str:
        snap, instruction = self.session.snap, self.session.goal.instruction_text
        page = snap.observation.split(instruction + " [SEP] ", 1)[-1]
        lines = ["### Instruction", instruction, "### Current page", page]
        if self.actions:
            lines += ["### Last actions", *self.actions[-self.keep_actions :]]
        if self.errors:
            lines += ["### Error", self.errors[-1]]
        lines += ["### Available actions", *snap.actions]
        return "\n".join(lines)

    def _render(self) -> None:
        text = self.render_text()
        self.history.turns = [Turn("user", self.codec.encode_message("user", text), text)]

    async def env_step(self, command: str) -> ToolOutput:
        try:
            ok, why = await self.session.act(command)
        except EnvServerError as e:
            self.env_error = str(e)
            raise ToolError(f"the shopping site is unreachable: {e}") from None
        self.actions.append(command)
        if not ok:
            raise ToolError(f"invalid action: {why}")
        return ToolOutput(f"ok: {command}", None, {"page": self.session.snap.page})

    async def step(self, action: Action) -> StepResult:
        anchor = self.session.snap.key
        self.errors = []
        res = await super().step(action)
        res.info["anchor_obs"] = anchor
        s = self.session.snap
        if self.env_error is not None:  # the site is gone: ended by ToolEnv, not trained on
            return res
        if s.page == "done":  # bought: the episode ends with WebShop's score
            won = s.reward == 1.0
            res.observation, res.done = None, True
            res.reward = (SUCCESS_REWARD if won else 0.0) + self.score_reward * s.reward
            res.info["reward"] = {"correct": won, "metrics": {"score": s.reward}, **s.reward_info}
        elif res.done:  # out of steps without a purchase, or cut (ToolEnv's penalty)
            res.reward = res.reward or 0.0
            res.info["reward"] = {"correct": False, "metrics": {"score": 0.0}}
        return res

    async def observe(self, outputs: list[ToolOutput], feedback: str) -> None:
        self.errors = [o.result for o in outputs if o.info.get("error")]
        self._render()

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
        await super().close()

    def answer_allowed(self) -> bool:
        return False  # the episode ends with a purchase (or at max_steps)

    def missing_call_message(self) -> str:
        return "call env_step with one action: search[...] or click[...]"


if AGENT not in AGENTS:
    AGENTS.register(AGENT)(AgentSpec(AgentEnvLoop, {"env": "webshop"}))
