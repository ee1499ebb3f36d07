"""One episode of an agent program: its chat completions become step records, token in / token out.

A call whose messages extend the session's previous call (its messages, then the reply exactly as
the gateway returned it) continues the conversation: the observation is the previous observation +
the sampled action ids + the closing tokens of the turn + the new messages' tokens, so nothing the
policy sampled is re-tokenised and the step's ``prefix_len`` covers the whole previous step. A call
that rewrote its history (dropped, edited or reordered messages, other tools) is rendered afresh:
a rewrite step (``info.rewrite``). Calls of one session run one at a time, in arrival order.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

from agent_r1.agent.chat import content_text
from agent_r1.agent.flow import action_step, common_prefix_len, step_images
from agent_r1.records.schema import StepRecord
from agent_r1.serving.openai_api import InvalidRequest, chat_message, render_messages
from agent_r1.vision.images import Image, ImageError


class SessionOver(Exception):
    """A call after the episode ended (its step limit or observation budget): the program is told
    why, and the episode ends truncated."""


class Session:
    def __init__(self, flow: Any, trajectory_id: str, group_id: str, api_key: str):
        self.flow, self.codec, self.config = flow, flow.codec, flow.config
        self.trajectory_id, self.group_id = trajectory_id, group_id
        self.id = secrets.token_hex(16)  # the path of the session: not guessable by other sessions
        self.api_key = api_key
        self.loop = asyncio.get_running_loop()  # where its steps run (the gateway serves elsewhere)
        self.steps: list[StepRecord] = []
        self.ended: str | None = None  # why the episode ended before the program did
        self.over = asyncio.Event()  # set with ``ended``: the program need not be waited for
        self.failure: BaseException | None = None  # the policy servers failed (the share runs again)
        self.reward: dict[str, Any] | None = None  # what the program posted: reward, success
        self._lock = asyncio.Lock()
        self._history: list[dict[str, Any]] | None = None  # the last call's messages and its reply
        self._tools: list[dict[str, Any]] | None = None
        self._context: list[int] = []  # the last observation + action + the turn's closing tokens
        self._images: list[Image] = []
        self._prev: list[int] = []  # the last observation + action (``prefix_len`` is against it)
        self._seen: set[str] = set()

    def end(self, reason: str) -> None:
        """The episode ends truncated: the last step is the terminal one."""
        if self.ended is None:
            self.ended = reason
            if self.steps:
                self.steps[-1].info["truncated_by"] = reason
            self.over.set()

    def observation(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None):
        """(ids, images, the messages new since the last reply, or None for a rewrite)."""
        h = self._history
        if h is not None and tools == self._tools and len(messages) > len(h) and messages[: len(h)] == h:
            new = messages[len(h) :]
            ids, images = self.codec.encode_turns(new, first=len(h))
            return self._context + ids + self.codec.generation_prompt_ids, self._images + images, new
        ids, images = self.codec.encode_chat_images(messages, tools)
        return ids, images, None

    def feedback(self, new: list[dict[str, Any]]) -> str:
        """A step's ``feedback``: its tool results as the built-in tool agent writes them, then any
        other message's text."""
        results = [(m.get("name"), content_text(m["content"])) for m in new if m["role"] == "tool"]
        others = [content_text(m["content"]) for m in new if m["role"] != "tool"]
        return "\n".join(([self.codec.feedback_text(results)] if results else []) + others)

    async def complete(
        self, raw_messages: Any, tools: list[dict[str, Any]] | None, max_tokens: int | None
    ) -> tuple[dict[str, Any], str, list[int], list[float], int]:
        """One call = one step: (the reply message, its finish reason, the action's ids and
        logprobs, the observation's length). Raises ``InvalidRequest`` for a bad request (nothing
        is recorded) and ``SessionOver`` once the episode has ended."""
        async with self._lock:
            if self.failure is not None:
                raise SessionOver(f"the policy servers failed under this episode: {self.failure}")
            if self.ended is not None:
                raise SessionOver(f"the episode has ended ({self.ended}); no more completions")
            t = len(self.steps)
            if t >= self.config.max_steps:
                self.end("max_steps")
                raise SessionOver(
                    f"step limit reached: this episode allows {self.config.max_steps} completions "
                    "(episode.max_steps)"
                )
            messages = render_messages(raw_messages)
            try:
                ids, images, new = self.observation(messages, tools)
            except (ImageError, ValueError) as e:
                raise InvalidRequest(str(e), "messages") from None
            if len(ids) > self.config.max_obs_tokens:
                self.end("obs_over_budget")
                raise SessionOver(
                    f"the prompt is {len(ids)} tokens, over this episode's budget of "
                    f"{self.config.max_obs_tokens} (episode.max_obs_tokens)"
                )
            if new is not None and self.steps:  # what the program answered the last step with
                self.steps[-1].feedback = self.feedback(new)
            try:
                action = await self.flow.act(ids, self.trajectory_id, t, images, max_tokens)
            except Exception as e:
                self.failure = e  # the servers failed, not the program: the flow re-raises it
                self.over.set()
                raise
            finish = "length" if action.finish_reason.is_truncated() else "stop"
            msg, finish = chat_message(self.codec, action.text, tools is not None, finish)
            self.steps.append(
                action_step(
                    self.trajectory_id,
                    self.group_id,
                    t,
                    ids,
                    action,
                    prefix_len=common_prefix_len(ids, self._prev),
                    reward=0.0,
                    process_reward=[None] * len(msg.get("tool_calls", [])),
                    info={"rewrite": bool(t and new is None)},
                    **step_images(images, self._seen),
                )
            )
            self._prev = ids + action.token_ids
            self._context = self._prev + self.codec.close_action(action.token_ids)
            self._history = messages + render_messages([msg])
            self._tools, self._images = tools, images
            return msg, finish, action.token_ids, action.logprobs, len(ids)

    @property
    def final_text(self) -> str:
        """The last reply's text (what a recipe's reward function scores)."""
        return self.codec.decode_action(self.steps[-1].action_token_ids) if self.steps else ""
