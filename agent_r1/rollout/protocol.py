"""The narrow protocol between the agent layer and the rollout layer.

The agent layer only knows ``async generate(token_ids, sampling) -> Completion``; SGLang servers,
the embedded engine and the transformers reference all sit behind it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol


class FinishReason(StrEnum):
    """Why an action (one generation) ended. SGLang reports stop / length / abort."""

    STOP = "stop"  # a stop token or stop string was produced
    LENGTH = "length"  # max_new_tokens or the context limit was hit
    ABORT = "abort"  # the request was aborted (server pause, client abort)
    ERROR = "error"  # the engine failed this request

    def is_truncated(self) -> bool:
        return self is FinishReason.LENGTH

    def is_error(self) -> bool:
        return self in (FinishReason.ABORT, FinishReason.ERROR)


@dataclass
class SamplingParams:
    """Per-request sampling settings (a subset of SGLang's ``sampling_params``)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None

    def to_sglang(self) -> dict[str, Any]:
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
    policy_version: int = 0


class GenerateFn(Protocol):
    """The only thing the agent layer knows about the rollout layer."""

    async def __call__(self, token_ids: list[int], sampling: SamplingParams) -> Completion: ...
