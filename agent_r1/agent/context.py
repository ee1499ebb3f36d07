"""Context management: how the environment turns its history into the next observation.

The history is kept as token ids: a protected prefix (system prompt + tool schemas), then turns
whose ids are exact (an assistant turn holds the sampled action ids). A context manager chooses
what of it the model sees next:

- ``append``: everything (the observation extends the previous one: prefix merging applies);
- ``sliding_window``: the prefix, the first ``keep_first`` turns (the task) and as many of the
  newest turns as fit in ``max_tokens``; never cuts the prefix or a turn in half;
- ``summarize``: when over ``max_tokens``, older turns are replaced by one summary turn; the summary
  then stays in the history. ``summarizer``: ``extractive`` (the start of each folded turn), or the
  name of a served model that writes it — ``policy`` (the model being trained, through the run's
  rollout servers) or a helper model (``rollout.helpers.summarizer=HF_DIR``). The summary is part
  of the next observation, not of an action: it is never trained on, and the step's ``prefix_len``
  (shared with the previous step's context) ends where the folded turns began;
- ``rewrite``: the environment re-renders the turns from its own state each step.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from agent_r1.agent.chat import ChatCodec
from agent_r1.agent.types import Observation
from agent_r1.agent_tools.services import NO_SERVICES, Services
from agent_r1.registry import Registry
from agent_r1.vision.images import Image


@dataclass
class Turn:
    role: str
    token_ids: list[int]
    text: str
    images: list[Image] = field(default_factory=list)  # one per <|image_pad|> run of token_ids


@dataclass
class History:
    prefix_ids: list[int]  # system + tool schemas; never cut
    turns: list[Turn] = field(default_factory=list)

    def total_tokens(self, turns: list[Turn] | None = None) -> int:
        return len(self.prefix_ids) + sum(len(t.token_ids) for t in (self.turns if turns is None else turns))


class ContextManager:
    """``update`` may rewrite the history (async: it may call a model); ``view`` picks what is seen."""

    def __init__(self, codec: ChatCodec, services: Services | None = None):
        self.codec = codec
        self.services = services or NO_SERVICES  # the environment's: a summariser model by name

    async def update(self, history: History) -> None:
        return None

    def select(self, history: History) -> list[Turn]:
        return history.turns

    def view(self, history: History) -> list[int]:
        return self.observation(history).token_ids

    def observation(self, history: History) -> Observation:
        """The next observation: ``view``'s ids with the images of the turns it shows (image
        tokens count in every budget: they are ids like the others)."""
        turns = self.select(history)
        images = [im for t in turns for im in t.images]
        ids = list(history.prefix_ids)
        for t in turns:
            ids += t.token_ids
        return Observation(token_ids=ids + self.codec.generation_prompt_ids, images=images or None)


CONTEXTS: Registry[type[ContextManager]] = Registry("context manager")


@CONTEXTS.register("append")
class AppendContext(ContextManager):
    pass


@CONTEXTS.register("rewrite")
class RewriteContext(ContextManager):
    """The env replaces ``history.turns`` itself (e.g. from structured state) before each view."""


@CONTEXTS.register("sliding_window")
class SlidingWindowContext(ContextManager):
    def __init__(
        self, codec: ChatCodec, max_tokens: int, keep_first: int = 1, services: Services | None = None
    ):
        super().__init__(codec, services)
        if max_tokens <= 0:
            raise ValueError(f"context.max_tokens must be > 0, got {max_tokens}")
        self.max_tokens, self.keep_first = max_tokens, keep_first

    def select(self, history: History) -> list[Turn]:
        head = history.turns[: self.keep_first]
        budget = self.max_tokens - history.total_tokens(head) - len(self.codec.generation_prompt_ids)
        tail: list[Turn] = []
        for t in reversed(history.turns[self.keep_first :]):
            if len(t.token_ids) > budget:
                break
            tail.append(t)
            budget -= len(t.token_ids)
        return head + tail[::-1]


Summarizer = Callable[[list[Turn]], Awaitable[str]]


async def extractive_summary(turns: list[Turn], max_chars_per_turn: int = 120) -> str:
    """Default hook: the start of each dropped turn, role-tagged. Cheap and deterministic."""
    return "\n".join(f"[{t.role}] {t.text.strip()[:max_chars_per_turn]}" for t in turns)


@CONTEXTS.register("summarize")
class SummarizeContext(ContextManager):
    def __init__(
        self,
        codec: ChatCodec,
        max_tokens: int,
        keep_first: int = 1,
        keep_last: int = 2,
        summarizer: Summarizer | str = "extractive",
        summary_tokens: int = 128,
        services: Services | None = None,
    ):
        super().__init__(codec, services)
        if max_tokens <= 0:
            raise ValueError(f"context.max_tokens must be > 0, got {max_tokens}")
        if summary_tokens < 1:
            raise ValueError(f"context.summary_tokens must be >= 1, got {summary_tokens}")
        self.max_tokens, self.keep_first, self.keep_last = max_tokens, keep_first, keep_last
        if summarizer == "extractive":
            summarizer = extractive_summary
        elif isinstance(summarizer, str):
            summarizer = served_summarizer(self.services.model(summarizer), summary_tokens)
        self.summarizer = summarizer

    async def update(self, history: History) -> None:
        gen = len(self.codec.generation_prompt_ids)
        if history.total_tokens() + gen <= self.max_tokens:
            return
        head, rest = history.turns[: self.keep_first], history.turns[self.keep_first :]
        if len(rest) <= self.keep_last:
            return  # nothing left to fold; the loop's obs budget ends the episode if still too long
        old, recent = rest[: len(rest) - self.keep_last], rest[len(rest) - self.keep_last :]
        text = "Summary of earlier steps:\n" + await self.summarizer(old)
        summary = Turn("user", self.codec.encode_message("user", text), text)
        history.turns = head + [summary] + recent


def model_summarizer(generate: Any, codec: ChatCodec, sampling: Any) -> Summarizer:
    """A summarise hook that asks a model (the policy or another one) through ``generate``."""

    async def summarize(turns: list[Turn]) -> str:
        transcript = "\n".join(f"{t.role}: {t.text}" for t in turns)
        ids = codec.encode_chat(
            [
                {
                    "role": "user",
                    "content": "Summarise these earlier steps briefly, keeping facts and numbers:\n"
                    + transcript,
                }
            ]
        )
        out = await generate(ids, sampling)
        return codec.decode_action(out.token_ids)

    return summarize


def served_summarizer(target: Any, max_new_tokens: int) -> Summarizer:
    """``model_summarizer`` over a served model (``policy`` or a helper model: a ``ServedModel``),
    greedy."""
    from agent_r1.rollout.protocol import SamplingParams

    codec = ChatCodec.load(target.model)
    sampling = SamplingParams(
        temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=list(codec.stop_token_ids)
    )

    async def generate(ids: list[int], params: Any) -> Any:
        client = await target.client()
        try:
            return await client(ids, params)
        finally:
            await client.close()

    return model_summarizer(generate, codec, sampling)


def build_context(
    codec: ChatCodec, name: str = "append", services: Services | None = None, **kwargs: Any
) -> ContextManager:
    return CONTEXTS.get(name)(codec, services=services, **kwargs)
