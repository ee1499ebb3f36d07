"""Let megatron-core run on CPU with gloo. Applied only when CUDA is absent: on a GPU machine
``apply()`` returns without touching anything.

Each patch answers one place megatron-core (0.16 to 0.19) assumes CUDA (see shared notes, megatron_cpu §3):
the "cuda" RNG tracker maps to the CPU RNG; ``torch.cuda.current_device()`` becomes the CPU
device; tensor factories asked for a cuda device build on CPU; ``Tensor.cuda`` is the identity;
``Tensor.type()`` reports ``torch.cuda.*`` names (type checks in the optimizer); synchronize and
empty_cache are no-ops, the current stream (and any new one: the MoE dispatcher's host-copy
stream) one that never waits; and ``dist.scatter`` makes its inputs contiguous, because gloo silently
sends the wrong bytes for non-contiguous tensors. Pipeline parallel also needs
``batch_p2p_sync=False`` in the TransformerConfig (set by the model builder on CPU).
"""

from __future__ import annotations

import contextlib
import logging

import torch

_APPLIED = False
_TARGET = torch.device("cpu")  # where "cuda" goes: the CPU, or the dry run's meta device
_FACTORIES = (
    "zeros", "ones", "empty", "full", "tensor", "as_tensor", "arange", "rand", "randn", "randint",
    "zeros_like", "ones_like", "empty_like", "full_like", "empty_strided",
)  # fmt: skip


def _cpu_device(kwargs: dict) -> dict:
    d = kwargs.get("device")
    if d is not None and (str(d).startswith("cuda") or (isinstance(d, int) and _TARGET.type != "cpu")):
        kwargs["device"] = _TARGET
    if kwargs.get("pin_memory"):
        kwargs["pin_memory"] = False
    return kwargs


class _HostStream:
    """What ``torch.cuda.current_stream()`` answers on CPU: host ops are already ordered."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event=None) -> _HostStream:  # an event that has always happened
        return self

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def __init__(self, *args, **kwargs) -> None:  # torch.cuda.Stream(device=..., priority=...)
        pass

    def __eq__(self, other: object) -> bool:  # host ops share one order: every stream is the same
        return isinstance(other, _HostStream)

    def __hash__(self) -> int:
        return 0


_HOST_STREAM = _HostStream()


def apply(target: torch.device | str = "cpu") -> bool:
    """Patch for CPU if needed (idempotent). Returns True when patches are active. ``target`` is
    where "cuda" tensors go: the CPU, or ``meta`` for a dry run (``learner.dry_run``; one per
    process, set before anything else applies the patches)."""
    global _APPLIED, _TARGET
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        if torch.device(target) != _TARGET:
            raise RuntimeError(f"cpu_compat already maps cuda to {_TARGET}, asked for {target}")
        return True
    _TARGET = torch.device(target)
    import megatron.core.tensor_parallel.random as mrandom

    torch.cuda.current_device = lambda: _TARGET
    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, device=-1, graph_safe=False: torch.set_rng_state(state)
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    # not manual_seed_all: torch.manual_seed calls it, aliasing it would recurse
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.empty_cache = lambda *a, **k: None
    # megatron-core >= 0.17 waits on the current stream for CUDA-graph events before a grad sync:
    # on CPU every op runs in program order, so the stream is one that never has to wait
    torch.cuda.current_stream = lambda *a, **k: _HOST_STREAM
    torch.cuda.Stream = _HostStream  # a class still (annotations use it): equal to the current stream
    torch.cuda.stream = lambda s=None: contextlib.nullcontext()
    # ``with torch.device(d)`` moves the factory calls it recognises, by identity, in a set built
    # once: built after the patch it would hold the wrappers, never see the originals they call,
    # and leave every tensor on the CPU (transformers' meta-device init then left non-persistent
    # buffers such as the rotary inv_freq uninitialised in HF models loaded after this point)
    torch.utils._device._device_constructors()
    for name in _FACTORIES:
        orig = getattr(torch, name)

        def wrapped(*args, __orig=orig, **kwargs):
            return __orig(*args, **_cpu_device(kwargs))

        setattr(torch, name, wrapped)
    torch.Tensor.cuda = lambda self, *a, **k: self if _TARGET.type == "cpu" else self.to(_TARGET)
    orig_type = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kw):
        if dtype is None:
            s = orig_type(self)
            if s.startswith("torch.cuda."):
                return s
            return s.replace("torch.meta.", "torch.", 1).replace("torch.", "torch.cuda.", 1)
        return orig_type(self, dtype, non_blocking, **kw)

    torch.Tensor.type = type_
    orig_scatter = torch.distributed.scatter

    def scatter(tensor, scatter_list=None, src=None, group=None, async_op=False, **kw):
        if scatter_list is not None:
            scatter_list = [x.contiguous() for x in scatter_list]
        return orig_scatter(tensor, scatter_list, src=src, group=group, async_op=async_op, **kw)

    torch.distributed.scatter = scatter
    _moe_host_splits()
    _scale_in_place()
    # on CPU the "cuda" RNG is the CPU RNG, so every tracker fork would log a harmless warning
    logging.getLogger("megatron.core.tensor_parallel.random").setLevel(logging.ERROR)
    _APPLIED = True
    return True


def _scale_into(chunk_size, noop_flag, tensor_lists, scale) -> None:
    """``megatron.core.utils.local_multi_tensor_scale`` (dst = src * scale per tensor pair, the
    stand-in for apex's kernel) written straight into dst: the original's ``dst.copy_(src * scale)``
    makes a full-size temporary of every tensor, and the embedding's (113 MB at SmolLM2's size) is
    fresh memory each time, page-faulted in (153 ms of a 4 s bf16 update, in the fp32-to-bf16 copy of
    the weights after each step and the gradient clip). The same values: one rounding to dst's
    dtype."""
    for src, dst in zip(tensor_lists[0], tensor_lists[1], strict=True):
        if scale == 1.0:
            dst.copy_(src)
        else:
            torch.mul(src, scale, out=dst)


def _scale_in_place() -> None:
    """Where Megatron fell back to its local ``multi_tensor_scale`` (no Transformer Engine, no
    apex: every CPU), use ``_scale_into`` instead."""
    from megatron.core import utils as mutils
    from megatron.core.optimizer import clip_grads, optimizer

    for module in (clip_grads, optimizer):
        if getattr(module, "multi_tensor_scale_impl", None) is mutils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = _scale_into


def _moe_host_splits() -> None:
    """The MoE alltoall dispatcher copies its split sizes to the host as numpy arrays, but only
    from a CUDA tensor (``maybe_move_tensor_to_cpu``): on the CPU they stayed tensors, which
    ``all_to_all_single`` refuses as split sizes. A host tensor asked for as numpy becomes one."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    orig = moe_utils.maybe_move_tensor_to_cpu

    def host(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return orig(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = host
    token_dispatcher.maybe_move_tensor_to_cpu = host
