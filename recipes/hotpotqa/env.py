"""hotpotqa: a ToolEnv whose observation is rebuilt each step from structured state (the
``rewrite`` context mode), as upstream's HotpotQA flow does:

    question, the passages found so far (each cut to ``passage_chars``; all of them to a character
    budget that shrinks x0.72 until the prompt fits ``max_prompt_tokens``, newest kept first), the
    searches made, and the last ``keep_errors`` error lines.

The system / tool-schema prefix is never cut. ``search`` may be called up to 4 times per step (run
concurrently); with ``force_search`` the first step must search (an answer there is an error
observation, not the end); the episode ends with an answer (no tool call) or after ``max_steps``.
"""

from __future__ import annotations

from typing import Any

from agent_r1.agent.context import Turn
from agent_r1.agent.env import ENVS
from agent_r1.agent.flow import AGENTS, AgentEnvLoop, AgentSpec
from agent_r1.agent.tool_env import ToolEnv
from agent_r1.agent.types import Observation
from agent_r1.agent_tools import ToolOutput
from recipes.hotpotqa.data import AGENT, SYSTEM, TOOLS

SHRINK = 0.72


@ENVS.register("hotpotqa")
class HotpotQAEnv(ToolEnv):
    CHAT_CONTINUES = False  # each chat message is a new question: the state starts anew

    def __init__(
        self,
        codec: Any,
        max_prompt_tokens: int = 1024,
        passage_chars: int = 1200,
        keep_errors: int = 3,
        force_search: bool = True,
        **kwargs: Any,
    ):
        kwargs.setdefault("tools", TOOLS)
        kwargs.setdefault("max_steps", 5)
        kwargs.setdefault("max_calls_per_step", 4)
        kwargs.setdefault("system_prompt", SYSTEM)
        super().__init__(codec, context="rewrite", **kwargs)
        if max_prompt_tokens < 1 or passage_chars < 1:
            raise ValueError("hotpotqa: max_prompt_tokens and passage_chars must be >= 1")
        self.max_prompt_tokens, self.passage_chars = max_prompt_tokens, passage_chars
        self.keep_errors, self.force_search = keep_errors, force_search
        self.question = ""
        self.passages: dict[str, tuple[str, str]] = {}  # id -> (title, text), in the order found
        self.searches: list[str] = []
        self.errors: list[str] = []

    def reset(self, prompt: list[dict[str, Any]] | None = None, **row: Any) -> Observation:
        users = [m["content"] for m in (prompt or []) if m["role"] == "user"]
        if not users:
            raise ValueError("hotpotqa: the row's prompt has no user message (the question)")
        self.start_history(prompt)
        self.question, self.passages, self.searches, self.errors = users[-1], {}, [], []
        self.num_steps = 0
        self._render()
        return self.context.observation(self.history)

    # ---- state -> observation ------------------------------------------------------------------
    def render_text(self, budget: int | None) -> str:
        lines = [f"Question: {self.question}"]
        if self.passages and budget != 0:
            shown, left = [], budget
            for title, text in reversed(list(self.passages.values())):  # newest first
                line = f"- {title}: {text[: self.passage_chars]}"
                if left is not None and len(line) > left:
                    break
                shown.append(line)
                left = None if left is None else left - len(line)
            if shown:
                lines += ["Passages:", *reversed(shown)]
        if self.searches:
            lines.append("Searches so far: " + "; ".join(f'"{q}"' for q in self.searches))
        if self.errors:
            lines += ["Errors:", *self.errors[-self.keep_errors :]]
        return "\n".join(lines)

    def _render(self) -> None:
        budget = 3 * self.max_prompt_tokens
        fixed = len(self.history.prefix_ids) + len(self.codec.generation_prompt_ids)
        while True:
            text = self.render_text(budget)
            ids = self.codec.encode_message("user", text)
            if fixed + len(ids) <= self.max_prompt_tokens or budget == 0:
                break
            budget = int(budget * SHRINK) if budget > 50 else 0
        self.history.turns = [Turn("user", ids, text)]

    # ---- ToolEnv hooks ---------------------------------------------------------------------------
    def answer_allowed(self) -> bool:
        return not (self.force_search and self.num_steps == 1)

    def missing_call_message(self) -> str:
        return "search first: call the search tool before answering"

    async def observe(self, outputs: list[ToolOutput], feedback: str) -> None:
        for o in outputs:
            if o.info.get("error"):
                self.errors.append(o.result)
                continue
            if "query" in o.info:
                self.searches.append(o.info["query"])
            for h in o.info.get("hits", []):
                self.passages.setdefault(h["id"], (h["title"], h["text"]))
        self._render()


if AGENT not in AGENTS:
    AGENTS.register(AGENT)(AgentSpec(AgentEnvLoop, {"env": "hotpotqa"}))
