"""``EpisodeSettings``: the step and token budgets and the sampling of an episode, declared once.

Training (the ``episode`` config slice), evaluation, inference, chat and ``agent-r1 rollout`` all
read their budgets from here, and the rollout task carries the settings whole to the workers, so
an evaluation runs under exactly the budgets the policy was trained with unless told otherwise.
``flow`` builds the ``FlowConfig`` an agent flow runs with (its defaults are these settings').
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from agent_r1.agent.types import SamplingParams

GREEDY = 0.0  # the temperature of evaluation, inference and chat unless told otherwise


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass
class EpisodeSettings:
    max_steps: int = field(default=4, metadata=_help("agent steps per episode (chat: per user message)"))
    max_obs_tokens: int = field(
        default=1024, metadata=_help("per-step observation budget; a longer one ends the episode truncated")
    )
    max_action_tokens: int = field(default=64, metadata=_help("per-step response budget"))
    temperature: float = field(default=1.0, metadata=_help("sampling temperature; 0 = greedy"))
    top_p: float = field(default=1.0, metadata=_help("nucleus sampling: in (0, 1]"))

    def __post_init__(self) -> None:
        for k in ("max_steps", "max_obs_tokens", "max_action_tokens"):
            if getattr(self, k) < 1:
                raise ValueError(f"episode.{k}: must be >= 1, got {getattr(self, k)}")
        if not self.temperature >= 0:
            raise ValueError(f"episode.temperature: must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"episode.top_p: must be in (0, 1], got {self.top_p}")

    @property
    def context_len(self) -> int:
        """The tokens one request can need: an observation at its budget and a full action."""
        return self.max_obs_tokens + self.max_action_tokens

    def flow(self, seed: int | None = None) -> FlowConfig:
        """The agent flow's config; ``seed`` makes sampling reproducible per trajectory and step."""
        sampling = SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            max_new_tokens=self.max_action_tokens,
            seed=seed,
        )
        return FlowConfig(self.max_steps, self.max_obs_tokens, self.max_action_tokens, sampling=sampling)

    def with_values(self, values: dict[str, Any]) -> EpisodeSettings:
        """These settings with ``values`` (keys named as the fields; None = keep) put in."""
        given = {k: v for k, v in values.items() if v is not None}
        unknown = set(given) - {f.name for f in fields(self)}
        if unknown:
            raise ValueError(f"episode: no setting named {sorted(unknown)[0]!r}")
        return replace(self, **given)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class FlowConfig:
    """What an agent flow runs with: the budgets, and the sampling of every request."""

    max_steps: int = EpisodeSettings.max_steps
    max_obs_tokens: int = EpisodeSettings.max_obs_tokens
    max_action_tokens: int = EpisodeSettings.max_action_tokens
    sampling: SamplingParams = field(default_factory=SamplingParams)

    def __post_init__(self) -> None:
        for k in ("max_steps", "max_obs_tokens", "max_action_tokens"):
            if getattr(self, k) < 1:
                raise ValueError(f"flow.{k} must be >= 1, got {getattr(self, k)}")
