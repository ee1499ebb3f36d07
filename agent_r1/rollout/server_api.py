"""What differs between the engines a ``RolloutClient`` talks to, in one place: the generate route
and its body, how the answer becomes a ``Completion``, the health route, where the weight
version is read, how a request is aborted. ``SERVER_APIS`` by name; ``server_api(engine)`` maps a
run's ``rollout.engine`` to one (the embedded engine speaks SGLang's API).

Both give the same ``Completion`` for the same request: the exact token ids sampled (a stop or EOS
token included, as SGLang returns it), one logprob per token under softmax(logits / T), finish
reason ``stop`` / ``length`` / ``abort``, and the weight version that generated it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

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
            "sampling_params": sampling.to_sglang(),
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


class VLLMAPI(ServerAPI):
    """vLLM's OpenAI ``/v1/completions`` with token ids in (``prompt``: a list of ints) and out
    (``return_token_ids``), the sampled tokens' logprobs (``logprobs: 0``; the server runs with
    ``--logprobs-mode processed_logprobs``, so they are taken after temperature as SGLang's are),
    special tokens kept; the weight version from the RL routes' ``/weight_info``."""

    name = "vllm"
    health_path = "/health"
    version_path = "/weight_info"
    rid_field = "request_id"
    version_in_answer = False  # read from /weight_info once the answer is in

    def generate(self, token_ids, sampling, images) -> Request:
        if images:
            raise ValueError(
                "rollout.engine=vllm serves text prompts only (images need engine=embedded or sglang)"
            )
        body: dict[str, Any] = {
            "prompt": list(token_ids),
            "max_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            "stop_token_ids": list(sampling.stop_token_ids),
            "logprobs": 0,
            "return_token_ids": True,
            "skip_special_tokens": False,
        }
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        return Request("/v1/completions", body)

    def completion(self, out: dict[str, Any]) -> Completion:
        choice = out["choices"][0]
        ids = list(choice.get("token_ids") or [])
        lps = (choice.get("logprobs") or {}).get("token_logprobs") or []
        if len(lps) != len(ids):
            raise ValueError(f"vLLM answered {len(ids)} token ids but {len(lps)} logprobs")
        reason = REASONS.get(choice.get("finish_reason") or "abort", FinishReason.ERROR)
        return Completion(ids, [float(x) for x in lps], reason)

    def version(self, info: Any) -> int:
        if isinstance(info, dict) and info.get("weight_version") in (None, "default"):
            return 0  # no push yet ("default" in 0.32): the model on disk, version 0
        return super().version(info)

    def abort(self, rid: str | None) -> Request:
        return Request("/abort_requests", {"request_ids": [rid]} if rid else {})


SERVER_APIS: dict[str, ServerAPI] = {"sglang": SGLangAPI(), "vllm": VLLMAPI()}
ENGINE_APIS = {"embedded": "sglang", "sglang": "sglang", "external": "sglang", "vllm": "vllm"}


def server_api(engine: str = "sglang") -> ServerAPI:
    """The API of a ``rollout.engine`` (or of an API name)."""
    name = ENGINE_APIS.get(engine, engine)
    if name not in SERVER_APIS:
        raise ValueError(f"no server API for engine {engine!r}: {sorted(ENGINE_APIS)}")
    return SERVER_APIS[name]
