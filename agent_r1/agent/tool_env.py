"""ToolEnv: chat history + Hermes tool calls, executed concurrently, answered as one user turn.

A bad call (malformed JSON, unknown tool, wrong argument types, an exception, a timeout) becomes
an error message in the feedback and, optionally, a negative process reward; never a crash. The
episode ends when an action has no tool call, when the action was cut by the length limit, or at
``max_steps``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from agent_r1.agent.chat import ChatCodec, content_text
from agent_r1.agent.context import History, Turn, build_context
from agent_r1.agent.env import ENVS, AgentEnv
from agent_r1.agent.tool_calls import MalformedCall, ToolCall
from agent_r1.agent.types import Action, Observation, StepResult
from agent_r1.agent_tools import TOOLS, BaseTool, ToolError, ToolOutput
from agent_r1.agent_tools.crop import ImageTool
from agent_r1.agent_tools.services import Services
from agent_r1.vision.images import Image


@ENVS.register("tool")
class ToolEnv(AgentEnv):
    def __init__(
        self,
        codec: ChatCodec,
        tools: list[str] | None = None,
        tool_kwargs: dict[str, dict[str, Any]] | None = None,
        context: str = "append",
        context_kwargs: dict[str, Any] | None = None,
        max_steps: int = 8,
        max_calls_per_step: int = 4,
        error_penalty: float = 0.0,
        tool_timeout_s: float | None = None,
        system_prompt: str | None = None,
        services: Services | None = None,
    ):
        super().__init__(codec, services)
        if max_steps < 1:
            raise ValueError(f"env.max_steps must be >= 1, got {max_steps}")
        tool_kwargs = tool_kwargs or {}
        # keyed by the name the model calls (a registered tool may show another name, e.g. a
        # recipe's own "search" registered as "paper_search")
        built = [TOOLS.get(n)(**tool_kwargs.get(n, {})) for n in tools or []]
        for t in built:
            t.services = self.services  # a tool uses the services of the environment it runs in
        self.tools: dict[str, BaseTool] = {t.name: t for t in built}
        if len(self.tools) != len(built):
            raise ValueError(f"tools {tools} show the model the same name twice")
        self.context = build_context(codec, context, self.services, **(context_kwargs or {}))
        self.max_steps, self.max_calls_per_step = max_steps, max_calls_per_step
        self.error_penalty, self.tool_timeout_s = error_penalty, tool_timeout_s
        self.system_prompt = system_prompt
        self.history = History([])
        self.num_steps = 0
        # set by an environment whose backing service or engine broke under the episode (a dead
        # site, a hung game engine): the step ends the episode with ``info.env_error``, and the
        # rollout worker counts and drops it, so it is never trained on
        self.env_error: str | None = None

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        return [t.schema for t in self.tools.values()]

    # ---- episode -------------------------------------------------------------------------------
    def start_history(self, prompt: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
        """A new episode's history holding the system turn (the row's own system message, else
        ``system_prompt``) with the tool schemas; returns the prompt's other messages."""
        self.env_error = None
        messages = list(prompt or [])
        system = self.system_prompt
        if messages and messages[0]["role"] == "system":
            system = messages.pop(0)["content"]
        self.history = History(self.codec.encode_system(system, self.tool_schemas))
        return messages

    def reset(self, prompt: list[dict[str, Any]] | None = None, **row: Any) -> Observation:
        messages = self.start_history(prompt)
        for i, m in enumerate(messages):
            ids, images = self.codec.encode_message_images(m["role"], m["content"], f"prompt message {i}")
            self.history.turns.append(Turn(m["role"], ids, content_text(m["content"]), images))
        self.num_steps = 0
        self._share_images()
        return self.context.observation(self.history)

    def _share_images(self) -> None:
        """Image tools see the images of the episode so far (prompt and tool results, in order)."""
        images = [im for t in self.history.turns for im in t.images]
        for tool in self.tools.values():
            if isinstance(tool, ImageTool):
                tool.images = images

    async def step(self, action: Action) -> StepResult:
        self.num_steps += 1
        ids = self.codec.generation_prompt_ids + action.token_ids + self.codec.close_action(action.token_ids)
        self.history.turns.append(Turn("assistant", ids, action.text))

        calls = self.codec.parse_tool_calls(action.text)
        if action.finish_reason.is_truncated():
            # a cut action cannot be trusted to hold a whole call: the episode ends. Where only the
            # environment ends episodes (no answers), the cut costs what an invalid call on every
            # step left would cost: else cutting itself short is the cheap way out of an episode
            # that collects penalties (an ALFWorld run collapsed into cut replies when it cost one)
            left = self.steps_allowed() - self.num_steps + 1
            cut = (
                -abs(self.error_penalty) * left if self.error_penalty and not self.answer_allowed() else None
            )
            return StepResult(None, cut, True, info={"truncated": True})
        if not calls and self.answer_allowed():  # no call: the agent answered
            return StepResult(None, None, True, info={"truncated": False})

        if calls:
            outputs = await asyncio.gather(*(self._run_call(c) for c in calls[: self.max_calls_per_step]))
        else:
            outputs = [self._error(self.missing_call_message(), None)]
        for c in calls[self.max_calls_per_step :]:
            outputs.append(
                self._error(f"too many tool calls in one step (max {self.max_calls_per_step}); ignored", c)
            )
        _, feedback = self.codec.encode_tool_results(self._results(outputs))
        await self.observe(outputs, feedback)

        info = {
            "tool_calls": [o.info for o in outputs],
            "num_tool_calls": len(outputs),
            "num_tool_errors": sum(1 for o in outputs if o.info.get("error")),
        }
        rewards = [o.reward for o in outputs]
        if self.env_error is not None:  # not the policy's doing: the episode ends here
            return StepResult(None, 0.0, True, feedback, rewards, {**info, "env_error": self.env_error})
        done = self.num_steps >= self.max_steps
        info["truncated"] = done  # out of steps without a final answer
        obs = None if done else self.context.observation(self.history)
        return StepResult(obs, None if done else 0.0, done, feedback, rewards, info)

    def steps_allowed(self) -> int:
        """The episode's real step limit: the env's own or the flow's, whichever comes first."""
        return min(self.max_steps, self.flow_max_steps or self.max_steps)

    # ---- chat ----------------------------------------------------------------------------------
    CHAT_CONTINUES = True  # a new user message extends the history (rewrite envs start anew)

    async def add_user_message(self, text: str) -> Observation:
        """``agent-r1 chat``: the user speaks again after the agent answered; the conversation
        goes on from the whole history, with a fresh step budget."""
        self.history.turns.append(Turn("user", self.codec.encode_message("user", text), text))
        await self.context.update(self.history)
        self.num_steps = 0
        return self.context.observation(self.history)

    # ---- hooks for environments built on this one ----------------------------------------------
    def answer_allowed(self) -> bool:
        """Whether an action without a tool call ends the episode now (else it is an error)."""
        return True

    def missing_call_message(self) -> str:
        return "this step needs a tool call"

    async def observe(self, outputs: list[ToolOutput], feedback: str) -> None:
        """Fold the step's tool outputs into the history (default: the chat format's tool-result
        turn(s), then the context manager). A ``rewrite`` environment rebuilds ``history.turns``
        from its state."""
        images: list[Image] = []
        ids, _ = self.codec.encode_tool_results(self._results(outputs, images))
        self.history.turns.append(Turn("tool", ids, feedback, images))
        await self.context.update(self.history)
        self._share_images()

    def _results(
        self, outputs: list[ToolOutput], images: list[Image] | None = None
    ) -> list[tuple[str | None, str]]:
        """(tool name, result text) per output; with ``images`` (a list to fill) each output's
        images follow its text as vision markup (a text-only model is told it got none)."""
        out = []
        for o in outputs:
            text = o.result
            if images is not None and o.images:
                if self.codec.vision is None:
                    text += f" [{len(o.images)} image(s) not shown: this model takes no images]"
                else:
                    text += "".join(self.codec.image_markup(im) for im in o.images)
                    images.extend(o.images)
            out.append((o.info.get("name"), text))
        return out

    # ---- tools ---------------------------------------------------------------------------------
    def _error(self, message: str, call: ToolCall | MalformedCall | None) -> ToolOutput:
        name = call.name if isinstance(call, ToolCall) else None
        penalty = -abs(self.error_penalty) if self.error_penalty else None
        return ToolOutput(f"Error: {message}", penalty, {"name": name, "error": message})

    async def _run_call(self, call: ToolCall | MalformedCall) -> ToolOutput:
        if isinstance(call, MalformedCall):
            return self._error(call.error, call)
        tool = self.tools.get(call.name)
        if tool is None:
            return self._error(f"unknown tool {call.name!r}; available: {sorted(self.tools)}", call)
        timeout = self.tool_timeout_s or tool.timeout_s
        try:
            tool.validate(call.arguments)
            out = await asyncio.wait_for(tool.execute(call.arguments), timeout)
        except ToolError as e:
            return self._error(f"{call.name}: {e}", call)
        except TimeoutError:
            return self._error(f"{call.name}: timed out after {timeout:g} s", call)
        except Exception as e:  # noqa: BLE001 - a tool bug must not end the episode; it is reported
            return self._error(f"{call.name} raised {type(e).__name__}: {e}", call)
        info = {"name": call.name, "error": None, **out.info}
        if out.images:
            info["images"] = len(out.images)
        return ToolOutput(out.result, out.reward, info, out.images)
