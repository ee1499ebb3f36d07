"""The narrow protocol between the agent layer and the rollout layer.

The agent layer only knows ``async generate(token_ids, sampling) -> Completion``; SGLang servers,
the embedded engine and the transformers reference all sit behind it. A prompt with images passes
them as ``images=[Image, ...]``, one per ``<|image_pad|>`` run of ``token_ids``, in order (SGLang's
``image_data``); a text prompt passes none, so text-only generate functions need not know them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from agent_r1.records.schema import FinishReason  # a step record's field; engines report it

__all__ = ["Completion", "FinishReason", "GenerateFn", "SamplingParams"]

# the abort message of a request a server interrupted for a weight update (the embedded engine's
# ``drain`` pause): the client resends it as a continuation on the new weights
INTERRUPTED_MESSAGE = "interrupted for a weight update"

GREEDY_BELOW = 1e-5  # temperatures under this sample greedily (dividing logits by them overflows)


def logprob_temperature(temperature: float) -> float:
    """The T of the logprobs a request at ``temperature`` gets back: log_softmax(logits / T), and
    untempered (T = 1) where it samples greedily, as SGLang. The learner recomputes them alike."""
    return temperature if temperature >= GREEDY_BELOW else 1.0


@dataclass
class SamplingParams:
    """Per-request sampling settings (a subset of SGLang's ``sampling_params``)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None

    def to_wire(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_new_tokens": self.max_new_tokens,
            "stop_token_ids": list(self.stop_token_ids),
        }
        if self.seed is not None:
            d["sampling_seed"] = self.seed
        return d


@dataclass
class Completion:
    """What a generate call returns: token ids and logprobs exactly as sampled."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    policy_version: int = 0  # the version that sampled the first token
    # an action a weight update interrupted: [[version, tokens it sampled], ...] in order; empty
    # when one version sampled every token (every action not interrupted)
    version_spans: list[list[int]] = field(default_factory=list)


class GenerateFn(Protocol):
    """The only thing the agent layer knows about the rollout layer."""

    async def __call__(self, token_ids: list[int], sampling: SamplingParams) -> Completion: ...


def image_kwargs(images: list[Any] | None) -> dict[str, Any]:
    """``generate``'s keyword arguments for a prompt's images: none for a text prompt."""
    return {"images": list(images)} if images else {}
