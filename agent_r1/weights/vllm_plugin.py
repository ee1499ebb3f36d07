"""vLLM's general-plugin entry point (``[project.entry-points."vllm.general_plugins"]``): registers
the ``agent_r1_gloo`` weight-transfer backend (``vllm_gloo.py``) by module path, so the module
loads only in a server started with ``--weight-transfer-config '{"backend": "agent_r1_gloo"}'``.
vLLM loads general plugins in every process it starts, possibly more than once."""

from __future__ import annotations

GLOO_BACKEND = "agent_r1_gloo"


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(
            GLOO_BACKEND, "agent_r1.weights.vllm_gloo", "GlooWeightTransferEngine"
        )
    except ValueError:  # already registered in this process
        pass
