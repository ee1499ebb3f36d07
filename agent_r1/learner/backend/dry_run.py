"""A learner rank without its GPU: the real Megatron-Core model, DDP, distributed optimizer and
update on tensors that hold no memory, for ``agent-r1 plan``.

PyTorch cannot run autograd on fake CUDA tensors without a CUDA device (a CPU build has no CUDA
device guard; a CUDA build without a device fails in the autograd engine's ``hasPrimaryContext``),
so the planned GPU is PyTorch's ``meta`` device: every op computes shapes and dtypes only, autograd
works, and a tensor of this rank's host (``cpu``) meeting one of its GPU (``meta``) in an op raises
the same device-mismatch error a CUDA run would. ``DryRun`` (a context manager):

* joins a ``fake`` process group of the preset's world size at this rank (collectives return at
  once, on any rank of any world) and checks each collective: a tensor NCCL would refuse (one on
  the host while the backend is NCCL) and a gather of every rank's objects or tensors over the
  whole world while weights are pushed are errors that name the caller;
* maps CUDA onto the planned device for Megatron-Core (``torch.cuda.current_device()``, tensor
  factories asked for ``cuda``, ``Tensor.cuda``);
* answers what only data could answer (``.item()`` of a GPU tensor: a finite loss, no inf in the
  gradients; ``nonzero`` of a mask: every element selected, the upper bound);
* counts the bytes of every tensor alive on the planned device (each storage once, released when
  the last tensor on it dies): ``live`` and ``peak`` (``MemoryTracker``, which measures real
  tensors the same way);
* plans the GPU path's fused kernels (Transformer Engine's attention, RMSNorm and RoPE keep no
  fp32 or L x L intermediates) in place of the local spec's composite ones, unless
  ``fused_kernels=False`` (then it plans exactly what the CPU learner runs);
* with ``schedule_limit`` K, runs each forward-backward schedule over the K largest of its
  micro-batches (in their order) instead of every one: the rest of the update (every record, the
  flat per-token buffers, the optimizer step) is as planned. Micro-batches of one size repeat the
  same memory pattern, and 1F1B holds at most ``pp`` of them at once, so K = pp + 1 reaches the
  steady state with the largest ones in flight: the peak of the whole schedule, at a fraction of
  the time (a preset's update has hundreds of micro-batches). The last one run is a largest, so
  what a schedule leaves behind (a later stage's model keeps its last received activation,
  Megatron's ``set_input_tensor``) is planned at its largest too, never below the full run.
"""

from __future__ import annotations

import contextlib
import functools
import traceback
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

DEVICE = torch.device("meta")

_ACTIVE: DryRun | None = None


class DryRunError(RuntimeError):
    """Something a GPU run would refuse: a tensor on the wrong device, a collective NCCL would
    refuse, a whole-world gather of the weights."""


def _caller(skip: tuple[str, ...] = ("torch/", "dry_run.py", "contextlib.py")) -> str:
    """The innermost frame outside torch and this module: ``file:line in function``."""
    for fr in reversed(traceback.extract_stack()[:-1]):
        if not any(s in fr.filename for s in skip):
            return f"{fr.filename}:{fr.lineno} in {fr.name}"
    return "?"


def where(exc: BaseException) -> str:
    """The innermost frame of an exception's traceback in the project's own code (outside
    site-packages), else the innermost outside torch and this module."""
    frames = [fr for fr in traceback.extract_tb(exc.__traceback__) if "dry_run.py" not in fr.filename]
    for keep in (lambda f: "site-packages" not in f, lambda f: "/torch/" not in f):
        for fr in reversed(frames):
            if keep(fr.filename) and "contextlib" not in fr.filename:
                return f"{fr.filename}:{fr.lineno} in {fr.name}"
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"


def describe(exc: BaseException) -> str:
    """One line for a dry run's failure: what, and where (meta is the planned GPU)."""
    msg = f"{type(exc).__name__}: {exc}"
    if "meta" in msg and "cpu" in msg:
        msg += " (meta is the planned GPU: a host tensor met a GPU tensor)"
    return f"{msg} (at {where(exc)})"


def _any_planned(args: Any) -> bool:
    from torch.utils._pytree import tree_leaves

    return any(isinstance(x, torch.Tensor) and x.device == DEVICE for x in tree_leaves(list(args)))


def _fake_collective(func: Any, args: Any) -> Any:
    """A c10d op on planned-device tensors (no meta kernel exists): the host kernel, which hands
    them to the fake group's backend (it reads no data and answers with a finished work)."""
    return func.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), *args)


class MemoryTracker(TorchDispatchMode):
    """Counts the bytes of every tensor alive on ``device`` (each storage once, from the op that
    made it until its last tensor dies): ``live``, ``peak``. On real tensors it measures what the
    allocator handed out; the dry run uses it on the planned device."""

    def __init__(self, device: torch.device | str):
        super().__init__()
        self.device = torch.device(device)
        self.live = self.peak = 0
        self._storages: dict[int, int] = {}
        self._host: set[int] = set()  # storages that stand for host memory (``untrack``)

    def track(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key = st._cdata
        if key in self._storages or key in self._host:
            return
        n = st.nbytes()
        self._storages[key] = n
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(st, self._release, key)

    def _release(self, key: int) -> None:
        self.live -= self._storages.pop(key, 0)

    def untrack(self, tensors: Any) -> None:
        """Never count these tensors' storages, nor a view of them made later (they stand for
        host memory, not the device's)."""
        for t in tensors:
            key = t.untyped_storage()._cdata
            self._host.add(key)
            self._release(key)

    def reset_peak(self) -> None:
        self.peak = self.live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = self.dispatch(func, args, kwargs or {})
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.device == self.device:
                self.track(t)
        return out

    def dispatch(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        return func(*args, **kwargs)


class _Mode(MemoryTracker):
    """The dry run's tracker: it also answers what only data could answer on the planned device."""

    def __init__(self, run: DryRun):
        super().__init__(DEVICE)
        self.run = run

    def dispatch(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        packet = func._overloadpacket
        if packet is torch.ops.aten._local_scalar_dense and args[0].device == DEVICE:
            return self.run.scalar(args[0])
        if packet is torch.ops.aten._to_copy and args[0].device == DEVICE:
            to = kwargs.get("device")
            if to is not None and torch.device(to).type == "cpu":  # to the host: zeros (no data here)
                x = args[0]
                return torch.zeros(x.shape, dtype=kwargs.get("dtype") or x.dtype)
        if func.namespace == "c10d" and _any_planned(args):
            return _fake_collective(func, args)
        return func(*args, **kwargs)


class Reducer:
    """``algos.reduce.TorchReducer`` in a dry run: the same collectives on the same device (so they
    are checked), and every rank taken to hold this rank's values (a fake group fills nothing)."""

    def __init__(self, group: Any, device: torch.device):
        self.group, self.device = group, device

    def allreduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t.to(self.device, copy=True), group=self.group)
        return t

    def allgather_cat(self, t: torch.Tensor) -> torch.Tensor:
        x = t.to(self.device)
        dist.all_gather(
            [torch.empty_like(x) for _ in range(dist.get_world_size(self.group))], x, group=self.group
        )
        return t


@dataclass
class Collective:
    op: str
    group_size: int
    nbytes: int
    caller: str


@dataclass
class DryRun:
    """One planned learner rank: ``rank`` of ``world``; ``backend`` is what the real run would use."""

    rank: int
    world: int
    backend: str = "nccl"
    pad_to: int = 0  # every packed stream's length must be a multiple of this (FP8's alignment)
    # the GPU path's fused kernels (Transformer Engine's spec: attention, RMSNorm, RoPE) stand in
    # for the local spec's composite ones; False plans exactly what the CPU learner runs
    fused_kernels: bool = True
    schedule_limit: int | None = None  # run each schedule over its K largest micro-batches
    microbatches: int = 0  # micro-batches the update's schedules hold (all, not only those run)
    max_tokens: int = 0  # the longest one's tokens
    collectives: list[Collective] = field(default_factory=list)
    pushing: bool = False  # inside the weight push: whole-world gathers are refused
    memory: MemoryTracker | None = None
    # what rank ``src``'s stage streams to rank 0 in the weight push: [(HF name, dtype, shape)]
    peer_export: Any = None
    _lengths: tuple[list[int], list[int]] = field(default_factory=lambda: ([], []))
    _stack: contextlib.ExitStack | None = None

    # ---- memory ----------------------------------------------------------------------------------
    @property
    def live(self) -> int:
        return self.memory.live

    @property
    def peak(self) -> int:
        return self.memory.peak

    def scalar(self, t: torch.Tensor) -> Any:
        """What ``.item()`` of a GPU tensor answers in a dry run: True for a flag (a finite loss),
        0 for a count or an inf check (nothing overflowed), 1.0 for a norm or a loss."""
        if t.dtype == torch.bool:
            return True
        if t.dtype.is_floating_point:
            return 1.0
        return 0

    # ---- collectives ------------------------------------------------------------------------------
    def _check(self, op: str, tensors: list[Any], group: Any) -> None:
        size = dist.get_world_size(group) if group is not None else self.world
        nbytes = 0
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            nbytes += t.numel() * t.element_size()
            if self.backend == "nccl" and t.device != DEVICE:
                raise DryRunError(
                    f"{op} on a {t.device} tensor {tuple(t.shape)} at {_caller()}: NCCL moves GPU "
                    "tensors only (use learner.device.collective_device)"
                )
        if (
            self.pushing
            and size == self.world
            and self.world > 1
            and ("gather" in op or op.endswith("_object"))
        ):
            raise DryRunError(
                f"{op} over the whole world ({size} ranks) during the weight push at {_caller()}: "
                "a stage's weights travel point to point to rank 0, never gathered from every rank"
            )
        self.collectives.append(Collective(op, size, nbytes, _caller()))

    def _wrap(self, name: str, tensor_args) -> None:
        orig = getattr(dist, name)

        @functools.wraps(orig)
        def checked(*args, **kwargs):
            group = kwargs.get("group")
            self._check(name, tensor_args(*args, **kwargs), group)
            return orig(*args, **kwargs)

        self._stack.callback(setattr, dist, name, orig)
        setattr(dist, name, checked)

    def _wrap_objects(self) -> None:
        """Object collectives pickle through tensors whose contents a fake group never fills:
        every rank is taken to hold what this one holds (data-parallel ranks are alike)."""
        orig = {n: getattr(dist, n) for n in ("all_gather_object", "broadcast_object_list", "gather_object")}

        def all_gather_object(out, obj, group=None):
            self._check("all_gather_object", [], group)
            out[:] = [obj] * len(out)

        def broadcast_object_list(objs, src=None, group=None, device=None, group_src=None):
            self._check("broadcast_object_list", [], group)

        def gather_object(obj, out=None, dst=0, group=None, group_dst=None):
            self._check("gather_object", [], group)
            if out is not None:
                out[:] = [obj] * len(out)

        def send_object_list(objs, dst=None, group=None, device=None, group_dst=None):
            self._check("send_object_list", [], group)

        streams: dict[int, Any] = {}

        def recv_object_list(objs, src=None, group=None, device=None, group_src=None):
            """A later stage's push, one tensor's (name, dtype, shape) at a time, then None."""
            self._check("recv_object_list", [], group)
            if src not in streams:
                streams[src] = iter([*self.peer_export(src), None])
            objs[0] = next(streams[src])
            if objs[0] is None:
                del streams[src]  # the next push streams the stage again

        orig.update({n: getattr(dist, n) for n in ("send_object_list", "recv_object_list")})
        for n, f in (
            ("send_object_list", send_object_list),
            ("recv_object_list", recv_object_list),
            ("all_gather_object", all_gather_object),
            ("broadcast_object_list", broadcast_object_list),
            ("gather_object", gather_object),
        ):
            self._stack.callback(setattr, dist, n, orig[n])
            setattr(dist, n, f)

    # ---- entering ---------------------------------------------------------------------------------
    def __enter__(self) -> DryRun:
        global _ACTIVE
        from torch.testing._internal.distributed.fake_pg import FakeStore

        if _ACTIVE is not None:
            raise RuntimeError("a dry run is already active in this process")
        self._stack = contextlib.ExitStack()
        dist.init_process_group("fake", store=FakeStore(), rank=self.rank, world_size=self.world)
        self._stack.callback(dist.destroy_process_group)
        one = lambda t, *a, **k: [t]  # noqa: E731
        lists = lambda out, *a, **k: [*out, *(a[:1])]  # noqa: E731
        # (isend / irecv stay as they are: P2POp checks them by identity; the batch is checked)
        for name, args in (
            ("all_reduce", one),
            ("broadcast", one),
            ("reduce", one),
            ("send", one),
            ("recv", one),
            ("all_gather", lists),
            ("gather", lambda t, out=None, *a, **k: [t, *(out or [])]),
            ("all_gather_into_tensor", lambda out, inp, *a, **k: [out, inp]),
            ("reduce_scatter_tensor", lambda out, inp, *a, **k: [out, inp]),
            ("all_to_all_single", lambda out, inp, *a, **k: [out, inp]),
        ):
            self._wrap(name, args)
        self._wrap_objects()
        batch = dist.batch_isend_irecv

        def batch_isend_irecv(ops):  # the fake group has no coalescing backend for the planned device
            self._check("batch_isend_irecv", [op.tensor for op in ops], ops[0].group if ops else None)
            return [op.op(op.tensor, op.peer, op.group, op.tag) for op in ops]

        self._stack.callback(setattr, dist, "batch_isend_irecv", batch)
        dist.batch_isend_irecv = batch_isend_irecv
        new_group = dist.new_group

        def fake_group(*args, **kwargs):  # Megatron's gloo side groups are fake ones here too
            kwargs.pop("backend", None)
            kwargs.pop("pg_options", None)
            return new_group(*args, **kwargs)

        self._stack.callback(setattr, dist, "new_group", new_group)
        dist.new_group = fake_group
        self._patch_megatron()
        import torch.fx.experimental._config as fx_config

        # a mask selects every element: the upper bound of what a mask-indexed tensor can hold
        self._stack.enter_context(fx_config.patch(meta_nonzero_assume_all_nonzero=True))
        _ACTIVE = self
        self._stack.callback(globals().__setitem__, "_ACTIVE", None)
        self.memory = self._stack.enter_context(_Mode(self))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    def _fuse(self) -> None:
        """The GPU path's fused kernels (Transformer Engine's spec), planned on the local spec: a
        norm and a rotary embedding that keep what TE keeps, not the fp32 rows of their composite
        (CPU) forms (attention: ``PackedAttention`` plans ``fused_plan.fused_attention``)."""
        from megatron.core.transformer import attention

        from agent_r1.learner.backend.fused_plan import _FusedRMSNorm, _FusedRope

        rms_forward = torch.nn.RMSNorm.forward
        rope = attention.apply_rotary_pos_emb
        self._stack.callback(setattr, torch.nn.RMSNorm, "forward", rms_forward)
        self._stack.callback(setattr, attention, "apply_rotary_pos_emb", rope)
        torch.nn.RMSNorm.forward = lambda norm, x: _FusedRMSNorm.apply(x, norm.weight)
        attention.apply_rotary_pos_emb = lambda t, *a, **k: _FusedRope.apply(t)

    def _plan_moe_routing(self) -> None:
        """A mixture-of-experts layer routes by values a dry run does not have: it plans dropless
        routing spread evenly, each token to its top k experts (``num_tokens * k`` rows permuted,
        dispatched and computed, split evenly over the experts and the EP ranks), which is what
        the memory of a dropless layer depends on (not which expert a token goes to)."""
        import numpy as np
        from megatron.core.transformer.moe import moe_utils, token_dispatcher

        dispatcher = token_dispatcher.MoEAlltoAllTokenDispatcher
        preprocess, permute = dispatcher.preprocess, moe_utils.permute

        def even_preprocess(disp, routing_map):
            if routing_map.device != DEVICE:
                return preprocess(disp, routing_map)
            k, experts, local = disp.config.moe_router_topk, disp.num_experts, disp.num_local_experts
            rows = routing_map.size(0) * k
            per = [rows // experts + (e < rows % experts) for e in range(experts)]
            disp.num_out_tokens = rows
            mine = per[disp.local_expert_indices[0] : disp.local_expert_indices[-1] + 1]
            if disp.ep_size > 1 or disp.tp_size > 1:
                sent = [sum(per[r * local : (r + 1) * local]) for r in range(disp.ep_size)]
                disp.input_splits = np.array(sent)
                disp.output_splits = np.array([sum(mine)] * disp.ep_size)  # every rank sends as much
                disp.output_splits_tp = np.array([sum(mine) * disp.ep_size] * disp.tp_size)
                received = torch.tensor([mine] * (disp.tp_size * disp.ep_size))
            else:
                received = torch.tensor([mine])
            if local > 1:
                disp.num_global_tokens_per_local_expert = received.view(-1, local)
            return received.sum(0)

        def even_permute(
            tokens, routing_map, probs=None, num_out_tokens=None, fused=False, drop_and_pad=False
        ):
            if tokens.device != DEVICE or drop_and_pad or num_out_tokens is None:
                return permute(tokens, routing_map, probs, num_out_tokens, fused, drop_and_pad)
            index = torch.empty(num_out_tokens, dtype=torch.long, device=DEVICE)
            picked = None if probs is None else probs.T.reshape(-1).index_select(0, index)
            return tokens.index_select(0, index), picked, index

        for owner, name, new in (
            (dispatcher, "preprocess", even_preprocess),
            (moe_utils, "permute", even_permute),
            (token_dispatcher, "permute", even_permute),
        ):
            self._stack.callback(setattr, owner, name, getattr(owner, name))
            setattr(owner, name, new)

    def schedule(self, micro: list[Any]) -> list[Any]:
        """The micro-batches (packed streams with ``num_tokens``) a forward-backward schedule runs:
        the ``schedule_limit`` largest (in order), after checking every stream's length against FP8's
        alignment."""
        run = self
        lengths = [mb.num_tokens for mb in micro]
        bad = [n for n in lengths if run.pad_to and n % run.pad_to]
        if bad:
            raise DryRunError(
                f"packed micro-batches of {bad[:5]} tokens at {_caller()}: not multiples of {run.pad_to} "
                "(optim.pad_multiple; Transformer Engine's FP8 GEMMs need them)"
            )
        run.microbatches += len(lengths)
        run.max_tokens = max([run.max_tokens, *lengths])
        k = run.schedule_limit
        if k is not None and len(micro) > k:
            keep = sorted(sorted(range(len(micro)), key=lambda i: -lengths[i])[:k])
            micro = [micro[i] for i in keep]
        run._lengths = _receive_order([mb.num_tokens for mb in micro])
        return micro

    def _patch_megatron(self) -> None:
        """CUDA means the planned device for Megatron-Core (``cpu_compat``, for the whole process:
        which is why a dry run has a process of its own), and what Megatron computes from data
        (pipeline shapes, its fallback gradient norm) comes from what the dry run knows."""
        from agent_r1.learner.backend import cpu_compat

        cpu_compat.apply(DEVICE)
        from megatron.core import utils as mutils
        from megatron.core.optimizer import clip_grads

        if self.fused_kernels:
            self._fuse()
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        shapes = P2PCommunicator._communicate_shapes

        def known_shapes(comm, tensor_send_next, tensor_send_prev, recv_prev, recv_next):
            # variable lengths exchange each micro-batch's shape as data, which a fake group does
            # not carry: the k-th activation (gradient) received is micro-batch k's, as in the
            # schedule's order (Actor._run tells the dry run the micro-batches' lengths)
            cfg = comm.config
            hidden = cfg.hidden_size
            split = cfg.tensor_model_parallel_size if cfg.sequence_parallel else 1  # SP: 1/tp of the rows
            prev = [self._lengths[0].pop(0) // split, 1, hidden] if recv_prev else None
            nxt = [self._lengths[1].pop(0) // split, 1, hidden] if recv_next else None
            return prev, nxt

        self._stack.callback(setattr, P2PCommunicator, "_communicate_shapes", shapes)
        P2PCommunicator._communicate_shapes = known_shapes
        self._plan_moe_routing()
        if clip_grads.l2_norm_impl is mutils.local_multi_tensor_l2_norm:
            # Megatron's fallback (no Apex / TE) builds the norm from host floats of every
            # tensor's norm; the same norm, kept on the device
            def l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
                norms = [torch.norm(t) for ts in tensor_lists for t in ts]
                return torch.stack(norms).norm().reshape(1).float(), None

            self._stack.callback(setattr, clip_grads, "l2_norm_impl", clip_grads.l2_norm_impl)
            clip_grads.l2_norm_impl = l2_norm


def _receive_order(lengths: list[int]) -> tuple[list[int], list[int]]:
    """The lengths of the activations (gradients) this rank receives, in the order the schedule
    receives them: micro-batch by micro-batch under 1F1B; under the interleaved schedule (virtual
    stages) Megatron's order of virtual micro-batches (groups of pp micro-batches per chunk, the
    chunks forward in order and backward in reverse), less the ones that come from no other rank
    (the first chunk of the first rank's forward input, the last chunk of the last rank's
    gradient)."""
    from megatron.core import parallel_state as ps

    vpp = ps.get_virtual_pipeline_model_parallel_world_size() or 1
    if vpp == 1:
        return list(lengths), list(lengths)
    pp, rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    group = pp  # Megatron's microbatch_group_size_per_vp_stage

    def chunk(k: int) -> int:
        return (k // group) % vpp

    def micro(k: int) -> int:
        return (k // (group * vpp)) * group + k % group

    total = len(lengths) * vpp
    fwd = [lengths[micro(k)] for k in range(total) if not (rank == 0 and chunk(k) == 0)]
    # backward runs the chunks in reverse: virtual micro-batch k's is chunk vpp - 1 - chunk(k)
    bwd = [lengths[micro(k)] for k in range(total) if not (rank == pp - 1 and chunk(k) == 0)]
    return fwd, bwd


_HF_STATES: dict[str, dict[str, torch.Tensor]] = {}


def hf_state(hf_config: Any) -> dict[str, torch.Tensor]:
    """Every weight of the HF model of ``hf_config`` by its checkpoint name, on the planned device
    (built once per process, outside the tracker: they stand for the files a real rank reads into
    host memory, and hold nothing: loading them checks shapes only)."""
    from torch.utils._python_dispatch import _disable_current_modes
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from agent_r1.checkpoint_names import unstack_experts
    from agent_r1.vision.qwen2_vl import checkpoint_name, is_vision_config

    key = hf_config.to_json_string()
    if key not in _HF_STATES:
        auto = AutoModelForImageTextToText if is_vision_config(hf_config) else AutoModelForCausalLM
        try:  # transformers >= 5, then 4.x: no weight initialisation (nothing to fill on meta)
            from transformers.initialization import no_init_weights
        except ImportError:
            from transformers.modeling_utils import no_init_weights
        with _disable_current_modes(), no_init_weights():
            # built on the host without touching a page (cpu_compat's factories hide the device
            # context), then moved to the planned device whole (tied weights stay one tensor)
            model = auto.from_config(hf_config, dtype=getattr(hf_config, "torch_dtype", None)).to(DEVICE)
            state = model.state_dict()
            # each expert its own tensor (HF stacks them; views would share one storage)
            state = {n: t.clone() if ".experts." in n else t for n, t in unstack_experts(state).items()}
        run = _ACTIVE
        if run is not None and run.memory is not None:  # the files a rank reads: host memory
            run.memory.untrack(state.values())
        if is_vision_config(hf_config):  # the checkpoint's names, as a rank reads them from files
            state = {checkpoint_name(n): t for n, t in state.items()}
        _HF_STATES[key] = dict(state)
    return dict(_HF_STATES[key])
