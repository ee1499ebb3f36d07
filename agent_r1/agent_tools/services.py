"""``Services``: what an episode uses besides the policy, handed down explicitly — ``run_episodes``
-> the agent flow -> its environment -> the environment's tools, context manager and selector.

A run's processes build theirs from the run (``train.services.run_services``: the retriever role,
the helper models, the environment server); the commands build theirs from their flags
(``local_services``). Nothing is found through a process-wide default: an environment or tool that
needs a service it was not given says which and how to give it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class EnvServer:
    """A recipe's environment as a service: its address (or a function that reads the current one:
    a restarted server may move) and the run's API key."""

    url: str | Callable[[], str]
    api_key: str | None = None

    def current(self) -> str:
        return self.url() if callable(self.url) else self.url


@dataclass(frozen=True)
class Services:
    retriever: Any = None  # the search tools' retriever (agent_r1.retrieval.client.Retriever)
    models: Mapping[str, Any] = field(default_factory=dict)  # served models by name: ServedModel
    env_server: EnvServer | None = None  # the recipe's environment service (rollout.env_server)
    api_key: str | None = None  # the run's API key: what the agent gateway's sessions require

    def search(self) -> Any:
        if self.retriever is None:
            raise LookupError(
                "no retriever: set retrieval.index=DIR in the run's config, give --index DIR, or give "
                "the search tool an index or url option (build one with agent-r1 index build)"
            )
        return self.retriever

    def model(self, name: str) -> Any:
        if name not in self.models:
            known = ", ".join(sorted(self.models)) or "none"
            raise ValueError(
                f"no model named {name!r} is served to this episode (known: {known}); in a run, set "
                f"rollout.helpers.{name}=HF_DIR and the launcher starts a {name!r} role"
            )
        return self.models[name]


NO_SERVICES = Services()
