"""webshop: a ToolEnv over the WebShop site (``shop.py``), its observation rebuilt every step
(the ``rewrite`` context mode): the instruction, the current page, the last actions and the
available actions. One ``env_step(command)`` call per step with ``search[...]`` or ``click[...]``.

Rewards per step: +10 when a purchase scores 1.0 (WebShop's success), -0.1 for an invalid action
or a reply without one call, else 0; the purchase's score in [0, 1] is logged (``rollout/score``,
``eval/score``). At most 15 steps. Each step records its page (``info.anchor_obs``) so GiGPO groups
the steps of a group's trajectories that stand on the same page.
"""

from __future__ import annotations

import functools
from typing import Any

from agent_r1.agent.context import History, Turn
from agent_r1.agent.env import ENVS
from agent_r1.agent.flow import AGENTS, AgentEnvLoop, AgentSpec
from agent_r1.agent.tool_env import ToolEnv
from agent_r1.agent.types import Action, Observation, StepResult
from agent_r1.tools import TOOLS, BaseTool, ToolError, ToolOutput
from recipes.webshop.catalog import Goal
from recipes.webshop.data import AGENT, SYSTEM, catalog
from recipes.webshop.shop import Session, Shop

SUCCESS_REWARD, INVALID_PENALTY = 10.0, 0.1


@functools.lru_cache(maxsize=4)
def shop_for(data: str | None, seed: int, human: bool) -> Shop:
    products, _, prices = catalog(data, seed, human)
    return Shop(products, prices)


@TOOLS.register("env_step")
class EnvStep(BaseTool):
    name = "env_step"
    description = "Take one action on the shopping site: search[keywords] or click[target]."
    parameters = {
        "type": "object",
        "properties": {
            "command": {"type": "string", "description": "e.g. search[red mug] or click[buy now]"}
        },
        "required": ["command"],
        "additionalProperties": False,
    }

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.env: WebShopEnv | None = None  # bound by the environment that owns it

    async def execute(self, args: dict[str, Any]) -> ToolOutput:
        if self.env is None:
            raise ToolError("env_step works only inside a WebShop environment")
        ok, why = self.env.shop.step(self.env.session, args["command"])
        self.env.actions.append(args["command"])
        if not ok:
            raise ToolError(f"invalid action: {why}")
        return ToolOutput(f"ok: {args['command']}", None, {"page": self.env.session.page})


@ENVS.register("webshop")
class WebShopEnv(ToolEnv):
    CHAT_CONTINUES = False

    def __init__(self, codec: Any, data: str | None = None, seed: int = 0, human: bool = False,
                 keep_actions: int = 3, **kwargs: Any):  # fmt: skip
        kwargs.setdefault("tools", ["env_step"])
        kwargs.setdefault("max_steps", 15)
        kwargs.setdefault("max_calls_per_step", 1)
        kwargs.setdefault("error_penalty", INVALID_PENALTY)
        kwargs.setdefault("system_prompt", SYSTEM)
        super().__init__(codec, context="rewrite", **kwargs)
        self.shop = shop_for(data, seed, human)
        self.tools["env_step"].env = self
        self.keep_actions = keep_actions
        self.session: Session | None = None
        self.actions: list[str] = []
        self.errors: list[str] = []

    def reset(self, prompt: list[dict[str, Any]] | None = None, **row: Any) -> Observation:
        goal = (row.get("extra_info") or {}).get("goal")
        if not isinstance(goal, dict):
            raise ValueError("webshop: the row's extra_info has no goal")
        messages = list(prompt or [])
        system = (
            messages.pop(0)["content"] if messages and messages[0]["role"] == "system" else self.system_prompt
        )
        self.history = History(self.codec.encode_system(system, self.tool_schemas))
        self.session, self.actions, self.errors = Session(Goal(**goal)), [], []
        self.num_steps = 0
        self._render()
        return Observation(token_ids=self.context.view(self.history))

    def render_text(self) -> str:
        s = self.session
        lines = ["### Instruction", s.goal.instruction_text, "### Current page", self.shop.observation(s).split(
            s.goal.instruction_text + " [SEP] ", 1)[-1]]  # fmt: skip
        if self.actions:
            lines += ["### Last actions", *self.actions[-self.keep_actions :]]
        if self.errors:
            lines += ["### Error", self.errors[-1]]
        lines += ["### Available actions", *self.shop.available_actions(s)]
        return "\n".join(lines)

    def _render(self) -> None:
        text = self.render_text()
        self.history.turns = [Turn("user", self.codec.encode_message("user", text), text)]

    async def step(self, action: Action) -> StepResult:
        anchor = self.shop.state_key(self.session)
        self.errors = []
        res = await super().step(action)
        res.info["anchor_obs"] = anchor
        s = self.session
        if s.page == "done":  # bought: the episode ends with WebShop's score
            won = s.reward == 1.0
            res.observation, res.done = None, True
            res.reward = SUCCESS_REWARD if won else 0.0
            res.info["reward"] = {"correct": won, "metrics": {"score": s.reward}, **s.reward_info}
        elif res.done:  # out of steps without a purchase
            res.reward = 0.0
            res.info["reward"] = {"correct": False, "metrics": {"score": 0.0}}
        return res

    async def observe(self, outputs: list[ToolOutput], feedback: str) -> None:
        self.errors = [o.result for o in outputs if o.info.get("error")]
        self._render()

    def answer_allowed(self) -> bool:
        return False  # the episode ends with a purchase (or at max_steps)

    def missing_call_message(self) -> str:
        return "call env_step with one action: search[...] or click[...]"


if AGENT not in AGENTS:
    AGENTS.register(AGENT)(AgentSpec(AgentEnvLoop, {"env": "webshop"}))
