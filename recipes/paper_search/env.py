"""paper_search: the observation is rebuilt each step from the environment's state (the paper
pool as two lists, expanded and candidate papers, plus the search / expand history), and each
step is paid a process reward:

    r_t = sum of the top-3 selector scores of the papers this step newly added to the pool
          (each score 1/0 at ``discretize`` when set) - ``call_cost`` per call
          - 0.5 per repeated query, per expand of an unknown or already expanded paper.

At the end (an answer without a tool call, or ``max_steps``) the found set is the pool's papers
the selector scores >= ``select_threshold``; its recall and F1 against the row's relevant papers
are the task metrics, and success is full recall.
"""

from __future__ import annotations

import re
from typing import Any

from agent_r1.agent.context import Turn
from agent_r1.agent.env import ENVS
from agent_r1.agent.flow import AGENTS, AgentEnvLoop, AgentSpec
from agent_r1.agent.tool_env import ToolEnv
from agent_r1.agent.types import Action, Observation, StepResult
from agent_r1.agent_tools import ToolOutput
from agent_r1.rewards import REWARDS, RewardResult
from recipes.paper_search import tools as _tools  # noqa: F401  (registers paper_search, expand)
from recipes.paper_search.data import AGENT, SYSTEM, TOOLS
from recipes.paper_search.graph import load_graph
from recipes.paper_search.selector import SELECTORS

PENALTY = 0.5


async def _maybe_await(x: Any) -> Any:
    import inspect

    return await x if inspect.isawaitable(x) else x


_ID = re.compile(r"\bP\d{4}\b")


def recall_f1(found: set[str], relevant: set[str]) -> dict[str, float]:
    hit = len(found & relevant)
    recall = hit / len(relevant) if relevant else 0.0
    precision = hit / len(found) if found else 0.0
    f1 = 2 * precision * recall / (precision + recall) if hit else 0.0
    return {"recall": recall, "precision": precision, "f1": f1}


@REWARDS.register("paper_recall")
def paper_recall(response: str, ground_truth: list[str]) -> RewardResult:
    """Recall of the paper ids a response names (for scoring a plain answer; the environment scores
    its own episodes from the found set)."""
    named = set(_ID.findall(response))
    m = recall_f1(named, set(ground_truth))
    return RewardResult(
        m["recall"], m["recall"] == 1.0, bool(named), ", ".join(sorted(named)) or None, {"metrics": m}
    )


@ENVS.register("paper_search")
class PaperSearchEnv(ToolEnv):
    CHAT_CONTINUES = False  # each chat message is a new question: the state starts anew

    def __init__(
        self,
        codec: Any,
        graph: str | None = None,
        seed: int = 0,
        selector: str = "lexical",
        selector_kwargs: dict[str, Any] | None = None,
        select_threshold: float = 0.75,
        discretize: float | None = None,
        call_cost: float = 0.0,
        show_candidates: int = 8,
        max_prompt_tokens: int = 1024,
        **kwargs: Any,
    ):
        kwargs.setdefault("tools", TOOLS)
        kwargs.setdefault("max_steps", 5)
        kwargs.setdefault("max_calls_per_step", 5)
        kwargs.setdefault("system_prompt", SYSTEM)
        tool_kwargs = kwargs.setdefault("tool_kwargs", {})
        tool_kwargs.setdefault("expand", {"graph": graph, "seed": seed})
        super().__init__(codec, context="rewrite", **kwargs)
        self.graph = load_graph(graph, seed)
        self.selector = SELECTORS.get(selector)(**(selector_kwargs or {}), services=self.services)
        self.select_threshold, self.discretize, self.call_cost = select_threshold, discretize, call_cost
        self.show_candidates, self.max_prompt_tokens = show_candidates, max_prompt_tokens
        self.query, self.relevant = "", set()
        self.pool: dict[str, float] = {}  # paper id -> selector score, in discovery order
        self.expanded: list[str] = []
        self.history_lines: list[str] = []
        self.errors: list[str] = []
        self.step_reward = 0.0

    def reset(
        self, prompt: list[dict[str, Any]] | None = None, reward_model: dict | None = None, **row: Any
    ) -> Observation:
        messages = [m for m in self.start_history(prompt) if m["role"] == "user"]  # the row's system turn
        if not messages:
            raise ValueError("paper_search: the row's prompt has no user message (the query)")
        self.query = messages[-1]["content"]
        self.relevant = set((reward_model or {}).get("ground_truth", []))
        self.pool, self.expanded, self.history_lines, self.errors = {}, [], [], []
        self.num_steps = 0
        self._render()
        return self.context.observation(self.history)

    def render_text(self, show: int) -> str:
        title = lambda pid: self.graph.papers[pid].title  # noqa: E731
        lines = [f"Query: {self.query}"]
        cands = [p for p in self.pool if p not in self.expanded]
        cands.sort(key=lambda p: -self.pool[p])  # stable: discovery order among equal scores
        if self.expanded:
            lines += ["Expanded papers:", *(f"[{p}] {title(p)}" for p in self.expanded[-show:])]
        if cands:
            shown = cands[:show]
            lines += [
                f"Candidate papers ({len(shown)} of {len(cands)}):",
                *(f"[{p}] {title(p)}" for p in shown),
            ]
        if self.history_lines:
            lines.append("History: " + "; ".join(self.history_lines))
        if self.errors:
            lines += ["Errors:", *self.errors[-3:]]
        return "\n".join(lines)

    def _render(self) -> None:
        """The state as one user turn; fewer papers listed until it fits ``max_prompt_tokens``
        (the system / tool prefix is never cut)."""
        fixed = len(self.history.prefix_ids) + len(self.codec.generation_prompt_ids)
        show = self.show_candidates
        while True:
            text = self.render_text(show)
            ids = self.codec.encode_message("user", text)
            if fixed + len(ids) <= self.max_prompt_tokens or show == 0:
                break
            show -= 1
        self.history.turns = [Turn("user", ids, text)]

    # ---- ToolEnv hooks ---------------------------------------------------------------------------
    async def observe(self, outputs: list[ToolOutput], feedback: str) -> None:
        new: list[str] = []
        penalty = 0.0
        for o in outputs:
            name, err = o.info.get("name"), o.info.get("error")
            if err:
                self.errors.append(o.result)
                penalty += PENALTY if name == "expand" else 0.0  # an unknown paper id
                continue
            if name == "search":
                q = o.info["query"]
                if q.lower() in (h[9:].lower() for h in self.history_lines if h.startswith("[Search] ")):
                    penalty += PENALTY
                    self.errors.append(f"Error: repeated query {q!r}")
                self.history_lines.append(f"[Search] {q}")
            elif name == "expand":
                pid = o.info["paper_id"]
                if pid in self.expanded:
                    penalty += PENALTY
                    self.errors.append(f"Error: {pid} is already expanded")
                else:
                    self.expanded.append(pid)
                    self.pool.setdefault(pid, 0.0)
                self.history_lines.append(f"[Expand] {pid}")
            new += [p for p in o.info.get("papers", []) if p not in self.pool and p not in new]
        unscored = [p for p in self.expanded if self.pool[p] == 0.0 and p not in new]  # found by id only
        try:
            scores = await _maybe_await(
                self.selector.scores(self.query, [self.graph.papers[p] for p in new + unscored])
            )
        except Exception as e:  # noqa: BLE001 - a dead judge: error feedback, the episode goes on
            self.errors.append(
                f"Error: the selector failed ({type(e).__name__}: {e}); these papers are unscored"
            )
            scores = [0.0] * (len(new) + len(unscored))
        for p, s in zip(new + unscored, scores, strict=True):
            self.pool[p] = s
        scores = scores[: len(new)]
        gains = sorted(scores, reverse=True)[:3]
        if self.discretize is not None:
            gains = [1.0 if s >= self.discretize else 0.0 for s in gains]
        self.step_reward = sum(gains) - self.call_cost * len(outputs) - penalty
        self._render()

    async def step(self, action: Action) -> StepResult:
        self.step_reward = 0.0
        res = await super().step(action)
        res.reward = self.step_reward
        if res.done:
            found = {p for p, s in self.pool.items() if s >= self.select_threshold}
            m = recall_f1(found, self.relevant)
            res.info["reward"] = {
                "correct": m["recall"] == 1.0,
                "formatted": True,
                "prediction": sorted(found),
                "metrics": m,
            }
        return res


if AGENT not in AGENTS:
    AGENTS.register(AGENT)(AgentSpec(AgentEnvLoop, {"env": "paper_search"}))
