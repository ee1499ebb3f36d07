"""What differs between the engines a ``RolloutClient`` talks to, in one place: the generate route
and its body, how the answer becomes a ``Completion``, the health route, where the weight
version is read, how a request is aborted. ``SGLangAPI`` is the project's own wire (the embedded
engine speaks it); an engine with another API brings its adapter (``engine_spec``:
``EngineSpec.api``), and ``server_api(engine)`` finds a run's.

Both give the same ``Completion`` for the same request: the exact token ids sampled (a stop or EOS
token included, as SGLang returns it), one logprob per token under softmax(logits / T), finish
reason ``stop`` / ``length`` / ``abort``, and the weight version that generated it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, ClassVar

from agent_r1.engine_spec import engine_spec
from agent_r1.rollout.protocol import Completion, FinishReason, SamplingParams

REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


def as_version(v: Any) -> int:
    """An integer weight version from a server's answer (SGLang and vLLM report a string); -1 for
    anything that is not a number."""
    try:
        return int(v)
    except (TypeError, ValueError):
        return -1


@dataclass(frozen=True)
class Request:
    path: str
    body: dict[str, Any]


class ServerAPI:
    name: ClassVar[str]
    health_path: ClassVar[str]  # answers 200 once the server can generate
    version_path: ClassVar[str]  # GET: a JSON object with "weight_version"
    rid_field: ClassVar[str]  # where a generate body carries its request id
    version_in_answer: ClassVar[bool] = True  # a generate answer says which weights made it

    def generate(self, token_ids: list[int], sampling: SamplingParams, images: list[Any] | None) -> Request:
        raise NotImplementedError

    def completion(self, out: dict[str, Any]) -> Completion:
        raise NotImplementedError

    def version(self, info: Any) -> int:
        return as_version(info.get("weight_version")) if isinstance(info, dict) else -1

    def abort(self, rid: str | None) -> Request:
        raise NotImplementedError


class SGLangAPI(ServerAPI):
    """SGLang's native ``/generate`` (also the embedded engine's)."""

    name = "sglang"
    health_path = "/health_generate"
    version_path = "/get_model_info"
    rid_field = "rid"

    def generate(self, token_ids, sampling, images) -> Request:
        body: dict[str, Any] = {
            "input_ids": list(token_ids),
            "sampling_params": sampling.to_wire(),
            "return_logprob": True,
        }
        if images:  # SGLang's field: one base64 image per <|image_pad|> run, in order
            body["image_data"] = [im.base64() for im in images]
        return Request("/generate", body)

    def completion(self, out: dict[str, Any]) -> Completion:
        meta = out["meta_info"]
        fr = (meta.get("finish_reason") or {}).get("type", "abort")
        triples = meta.get("output_token_logprobs")
        ids = out.get("output_ids") or ([t[1] for t in triples] if triples else [])
        logprobs = [float(t[0]) for t in triples] if triples else [0.0] * len(ids)
        return Completion(
            list(ids), logprobs, REASONS.get(fr, FinishReason.ERROR), max(self.version(meta), 0)
        )

    def abort(self, rid: str | None) -> Request:
        return Request("/abort_request", {"rid": rid or "", "abort_all": rid is None})


@functools.cache
def server_api(engine: str = "embedded") -> ServerAPI:
    """The API adapter of a ``rollout.engine`` (``engine_spec``); the embedded engine, SGLang and
    external servers speak SGLang's."""
    try:
        return engine_spec(engine).load("api")()
    except ValueError as e:
        raise ValueError(f"no server API: {e}") from None
