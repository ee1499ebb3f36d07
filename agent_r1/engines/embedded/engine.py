"""The embedded rollout engine: continuous batching on a slot KV cache, prefix sharing, SGLang's
sampling and control semantics. One scheduler thread owns the model; other threads submit
requests and issue control operations between scheduler steps.

A step: admit waiting requests (reusing the longest cached or running prefix) -> chunked prefill
under a token budget; a request whose prefill completes forks the waiting requests with the same
tokens (the other ``n`` samples of its group: a KV copy and the same next-token logits, so a group
prefills its prompt once) -> one decode token for every running request, attending over a group's
shared prompt once for all its samples -> retire finished requests (their KV may stay in the
prefix cache).

Qwen2-VL-family models take images (SGLang's ``image_data``, one per ``<|image_pad|>`` run of
``input_ids``): the vision tower runs once per image (cached by its hash), its output replaces the
pads' embeddings in prefill, and rotary positions follow the model's multimodal layout. Prefix
matching sees each pad as its image's hash, so two prompts share KV only where their images agree.
"""

from __future__ import annotations

import itertools
import logging
import os
import stat
import threading
import time
from collections import deque
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from agent_r1.checkpoint_names import unstack_experts
from agent_r1.cpus import ThreadGovernor, keep_freed_blocks
from agent_r1.engines.embedded.decode import Decoder
from agent_r1.engines.embedded.intake import Intake
from agent_r1.engines.embedded.requests import PrefixCache, Request
from agent_r1.engines.embedded.scheduler import Scheduler
from agent_r1.engines.embedded.slot_model import SlotModel
from agent_r1.engines.embedded.vision import VisionTower
from agent_r1.http_service import BadRequest
from agent_r1.rollout.protocol import INTERRUPTED_MESSAGE
from agent_r1.vision.images import VisionSpec
from agent_r1.vision.qwen2_vl import hf_module_name, is_vision_config

PAUSE_MODES = ("abort", "retract", "in_place", "drain")
INTERRUPTED = {"type": "abort", "message": INTERRUPTED_MESSAGE, "status_code": None, "err_type": None}

log = logging.getLogger("agent_r1.engine")


class Engine(Intake, Scheduler, Decoder):
    def __init__(
        self,
        model_dir: str | Path,
        dtype: str = "float32",
        max_running: int = 64,
        max_len: int | None = None,
        prefill_chunk: int = 2048,
        prefix_cache_tokens: int = 32768,
        threads: int | None = None,
        device: str = "cpu",
        adapt_threads: bool = True,
        max_prompt_tokens: int = 0,
        batch_invariant: bool = False,
    ):
        """``threads``: torch threads of the scheduler thread; with ``adapt_threads`` (CPU, more
        than one thread) the count is chosen step by step between 1 and ``threads`` from measured
        step times (``cpus.ThreadGovernor``: many threads collapse when the cores are shared).
        ``max_prompt_tokens``: longer prompts are refused (413); 0: the context length bounds them.
        ``batch_invariant`` (``trainer.deterministic``): a request's tokens and logprobs are the same
        bits alone, in a full batch and in any arrival order (given its ``sampling_seed``): batch-
        invariant linear layers, no cascade attention, a fixed thread count."""
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
        if threads:
            torch.set_num_threads(threads)
        self._threads = threads  # None: torch's default in the main thread, 1 in a background thread
        adapt = adapt_threads and not batch_invariant and device == "cpu" and bool(threads) and threads > 1
        self.governor = ThreadGovernor(threads) if adapt else None
        self.model_dir = str(model_dir)
        self.dtype = dtype
        self.device = torch.device(device)  # the model and KV cache; sampling stays on the host
        if self.device.type == "cpu":  # each step's logits and activations reuse freed blocks:
            keep_freed_blocks()  # 1.07-1.09x on SmolLM2's uniform workload (no page faults)
        vision = is_vision_config(AutoConfig.from_pretrained(self.model_dir))
        auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
        self.model = auto.from_pretrained(self.model_dir, dtype=getattr(torch, dtype)).to(self.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        cfg = self.model.config
        text_cfg = cfg.text_config if vision else cfg
        # a vision model: its tower (features cached by image hash) and image geometry
        self.vision = VisionTower(self.model, self.model_dir) if vision else None
        self.vision_spec = VisionSpec.from_folder(self.model_dir) if vision else None
        if vision and self.vision_spec is None:
            raise ValueError(f"{self.model_dir}: a vision model without preprocessor_config.json")
        self.vocab_size = int(text_cfg.vocab_size)
        self.eos_ids = self._eos_ids(cfg)
        self.context_len = int(getattr(text_cfg, "max_position_embeddings", 4096))
        self.max_len = min(max_len or self.context_len, self.context_len)
        self.max_running = max_running
        self.max_prompt_tokens = max_prompt_tokens
        self.prefill_chunk = prefill_chunk
        self.sm = SlotModel(self.model, max_running, self.max_len, batch_invariant)
        self.cache = PrefixCache(prefix_cache_tokens)
        self.weight_version = "default"
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.paused: str | None = None  # None | abort | retract | in_place | drain
        self.lock = threading.RLock()
        self.cv = threading.Condition(self.lock)
        self._stop = False
        self._waiters = 0  # control calls waiting for the lock: the scheduler yields to them
        self._waiters_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._share_keys = itertools.count()
        self._rng = torch.Generator().manual_seed(int(time.time_ns() % (1 << 31)))
        self.stats = {
            "generated_tokens": 0,
            "prefill_tokens": 0,
            "cached_tokens": 0,
            "steps": 0,
            "shared_prefix_steps": 0,
            "idle_s": 0.0,  # seconds the scheduler had nothing to run (waiting, or paused)
        }

    def _eos_ids(self, cfg: Any) -> set[int]:
        eos = getattr(cfg, "eos_token_id", None)
        ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    @contextmanager
    def _control(self) -> Iterator[None]:
        """Take the engine lock from another thread without starving behind the scheduler loop."""
        with self._waiters_lock:
            self._waiters += 1
        try:
            with self.cv:
                yield
        finally:
            with self._waiters_lock:
                self._waiters -= 1

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> Engine:
        """Run the scheduler in a background thread (in-process use, tests). For throughput run it
        in the main thread with ``run_forever`` (``agent-r1 serve`` does): OpenMP intra-op threads
        started from a secondary thread were measured 1.5-2x slower on these CPUs."""
        self._thread = threading.Thread(
            target=self._loop, args=(self._threads or 1,), name="engine", daemon=True
        )
        self._thread.start()
        return self

    def run_forever(self) -> None:
        """The scheduler loop in the calling thread, until ``stop()``."""
        self._thread = threading.current_thread()
        self._loop(self._threads)

    def stop(self) -> None:
        with self._control():
            self._stop = True
            self.cv.notify_all()
        if (
            self._thread
            and self._thread is not threading.current_thread()
            and self._thread is not threading.main_thread()
        ):
            self._thread.join(timeout=10)

    # ---- requests --------------------------------------------------------------------------------
    def submit(self, reqs: list[Request]) -> None:
        with self._control():
            self.waiting.extend(reqs)
            self.cv.notify_all()

    def generate_sync(
        self, input_ids: list[int], sampling: dict[str, Any] | None = None, **kw: Any
    ) -> list[Request]:
        """Blocking helper for in-process use and tests."""
        reqs = self.make_requests(input_ids, sampling, **kw)
        done = threading.Event()
        left = [len(reqs)]

        def cb(r: Request, finished: bool) -> None:
            if finished:
                left[0] -= 1
                if left[0] == 0:
                    done.set()

        for r in reqs:
            r.on_update = cb
        self.submit(reqs)
        done.wait()
        return reqs

    # ---- control ---------------------------------------------------------------------------------
    def abort(self, rid: str = "", abort_all: bool = False, rids: Collection[str] = ()) -> int:
        """Abort request ``rid`` (and its ``rid-k`` samples), every one of ``rids`` (a client's whole
        batch: one pass over the queues however large it is), or all; how many were aborted."""
        wanted = set(rids)
        with self._control():
            n = 0
            for r in list(self.waiting) + list(self.running):
                if abort_all or r.rid in wanted or (rid and (r.rid == rid or r.rid.startswith(f"{rid}-"))):
                    self._finish(
                        r, {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
                    )
                    n += 1
            self._retire()
            self.cv.notify_all()
            return n

    def pause(self, mode: str = "abort", interrupt_tokens: int = 0) -> int:
        """SGLang's modes (``abort``, ``retract``, ``in_place``) and ``drain``, the step-atomic one
        a weight push uses: nothing new is admitted, every running request finishes on the weights
        it started with, and the call returns once none runs; with ``interrupt_tokens`` > 0 a
        running request that has already generated that many tokens is aborted instead (its tokens
        so far come back, finish reason ``abort``, message ``INTERRUPTED``: the client resends it
        as a continuation). Returns how many requests were interrupted (aborted, for ``abort``)."""
        if mode not in PAUSE_MODES:
            raise BadRequest(f"mode: must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        if mode == "drain" and interrupt_tokens < 0:
            raise BadRequest(f"interrupt_tokens: must be >= 0, got {interrupt_tokens}")
        n = 0
        with self._control():
            self.paused = mode
            if mode == "abort":
                n = self.abort(abort_all=True)
            elif mode == "retract":
                self._retract_running()
            elif mode == "drain" and interrupt_tokens > 0:
                for r in self.running:
                    if r.state != "done" and len(r.out_ids) >= interrupt_tokens:
                        self._finish(r, dict(INTERRUPTED))
                        n += 1
                self._retire()
        if mode == "drain":  # wait outside ``_control``: the scheduler must keep stepping
            with self.cv:
                while self.running and self.paused == "drain" and not self._stop:
                    self.cv.wait(timeout=0.05)
        return n

    def resume(self) -> None:
        with self._control():
            self.paused = None
            self.cv.notify_all()

    def flush_cache(self) -> bool:
        """Drop the prefix cache; refused while requests run (or wait, unless paused: SGLang's
        ``is_fully_idle(ignore_waiting=paused)``, so a push can flush between pause and continue)."""
        with self._control():
            if self.running or (self.waiting and self.paused is None):
                return False
            self.cache.clear()
            return True

    def update_weights(self, tensors: dict[str, torch.Tensor], version: str | None = None) -> None:
        """Copy HF-named tensors into the model in place (all checked first: nothing applied on error)."""
        with self._control():
            params = checkpoint_tensors(self.model)
            if self.vision is not None:  # checkpoint names (model.layers.*, visual.*) -> modules
                tensors = {hf_module_name(n): t for n, t in tensors.items()}
            for name, t in tensors.items():
                if name not in params:
                    raise BadRequest(f"names: unknown parameter {name!r}")
                if tuple(t.shape) != tuple(params[name].shape):
                    raise BadRequest(
                        f"shapes: {name} has shape {tuple(t.shape)}, model has {tuple(params[name].shape)}"
                    )
                if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                    raise BadRequest(f"{name}: holds NaN or infinite values; the serving weights are kept")
            with torch.no_grad():
                for name, t in tensors.items():
                    params[name].copy_(t.to(params[name].dtype))
            self.sm.refresh()  # fused weights
            self.cache.clear()  # cached KV came from the old weights
            if self.vision is not None:
                self.vision.clear()  # and the image features from the old tower
            if version is not None:
                self.weight_version = str(version)

    def update_weights_from_disk(self, model_path: str, version: str | None = None) -> None:
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        files = checkpoint_files(model_path)
        tensors: dict[str, torch.Tensor] = {}
        for f in files:
            try:
                tensors.update(load_file(str(f)))
            except (OSError, SafetensorError) as e:  # torn, truncated, not safetensors at all
                raise BadRequest(f"model_path: {f} is not a readable safetensors file: {e}") from None
        self.update_weights(tensors, version)

    def loads(self) -> dict[str, Any]:
        with self.lock:
            used = sum(r.computed for r in self.running)
            return {
                "num_running_reqs": len(self.running),
                "num_waiting_reqs": len(self.waiting),
                "num_used_tokens": used,
                "num_total_tokens": self.max_running * self.max_len,
                "max_total_num_tokens": self.max_running * self.max_len,
                "max_running_requests": self.max_running,
                "token_usage": used / (self.max_running * self.max_len),
                "cache_hit_rate": self.stats["cached_tokens"]
                / max(1, self.stats["cached_tokens"] + self.stats["prefill_tokens"]),
            }


def checkpoint_files(model_path: str) -> list[Path]:
    """The ``*.safetensors`` files of a weights folder a client named, each a regular file (a FIFO
    or a device would block the loader's open, which holds the GIL: the whole server would hang);
    a path the filesystem refuses (too long, missing, not a folder) is a BadRequest naming it."""
    root = Path(model_path)
    try:
        if not stat.S_ISDIR(os.stat(root).st_mode):
            raise BadRequest(f"model_path: {model_path!r} is not a folder")
        files = sorted(root.glob("*.safetensors"))
        for f in files:
            if not stat.S_ISREG(os.stat(f).st_mode):
                raise BadRequest(f"model_path: {f} is not a regular file")
    except OSError as e:
        raise BadRequest(f"model_path: {e.strerror or e} ({model_path[:200]!r})") from None
    if not files:
        raise BadRequest(f"model_path: no *.safetensors files in {model_path!r}")
    return files


def checkpoint_tensors(model: Any) -> dict[str, torch.Tensor]:
    """The model's tensors under the names its checkpoint (and a weight push) uses: parameters,
    buffers, a tied ``lm_head.weight``, each expert of an MoE layer on its own (a view)."""
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    if "lm_head.weight" not in params and getattr(model.config, "tie_word_embeddings", False):
        params["lm_head.weight"] = model.get_output_embeddings().weight
    return unstack_experts(params)
