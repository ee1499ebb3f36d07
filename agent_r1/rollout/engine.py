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
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from agent_r1.checkpoint_names import unstack_experts
from agent_r1.cpus import ThreadGovernor, keep_freed_blocks
from agent_r1.rollout.sampling import Sampling, is_token_id, sample_batch
from agent_r1.rollout.slot_model import SlotModel
from agent_r1.rollout.vision import VisionTower
from agent_r1.service import BadRequest
from agent_r1.vision.images import Image, ImageError, VisionSpec, load_image, pad_runs
from agent_r1.vision.qwen2_vl import hf_module_name, is_vision_config, mrope_positions

log = logging.getLogger("agent_r1.engine")


@dataclass
class Request:
    rid: str
    prompt: list[int]
    sampling: Sampling
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    index: int = 0
    on_update: Callable[[Request, bool], None] | None = None  # (request, finished), scheduler thread
    out_ids: list[int] = field(default_factory=list)
    out_logprobs: list[float] = field(default_factory=list)
    out_top: list[list[tuple[float, int]]] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    state: str = "waiting"  # waiting | prefill | decode | done
    slot: int = -1
    computed: int = 0  # KV positions valid in the slot
    cached_tokens: int = 0
    retractions: int = 0
    finish: dict[str, Any] | None = None
    weight_version: str = "default"
    created: float = field(default_factory=time.time)
    finished_at: float = 0.0
    gen: torch.Generator | None = None  # own generator when seeded, else the engine's shared one
    stops: frozenset[int] = frozenset()  # stop token ids (+ EOS unless ignore_eos)
    # (key, P): KV positions 0..P-1 are the same as those of every running request with this key
    # (the samples of one group); decode attends over that shared prefix once per group
    shared: tuple[int, int] | None = None
    images: list[Image] = field(default_factory=list)  # one per <|image_pad|> run, in order
    image_pad: int = -1  # the model's <|image_pad|> id (image requests)
    rope: torch.Tensor | None = None  # (3, len(prompt)) multimodal rotary positions
    rope_delta: int = 0  # rotary position - cache position for tokens after the prompt
    features: torch.Tensor | None = None  # (pads, hidden): the images' embeddings, pad by pad
    _prompt_arr: np.ndarray | None = None

    @property
    def prompt_arr(self) -> np.ndarray:
        """The prompt as prefix matching sees it: an image pad is its image's key (negative)."""
        if self._prompt_arr is None:
            arr = np.asarray(self.prompt, dtype=np.int64)
            if self.images:
                arr = arr.copy()
                for im, (a, b) in zip(self.images, self.pad_runs(), strict=True):
                    arr[a:b] = -1 - int(im.hash[:15], 16)
            self._prompt_arr = arr
        return self._prompt_arr

    def pad_runs(self) -> list[tuple[int, int]]:
        """(start, end) of each image's pad run in the prompt."""
        return pad_runs(self.prompt, self.image_pad)

    def key_tokens(self, n: int) -> list[int]:
        """The first ``n`` tokens in the keyed form (for the prefix cache)."""
        p = self.prompt_arr.tolist()
        return (p + self.out_ids)[:n]

    def common_prefix(self, toks: np.ndarray, limit: int) -> int:
        """Length of the common prefix of this request's first ``limit`` tokens and ``toks``."""
        p = self.prompt_arr
        n = _lcp(p[:limit], toks)
        if n < min(len(p), limit) or limit <= len(p):
            return n
        return n + _lcp(np.asarray(self.out_ids[: limit - len(p)], dtype=np.int64), toks[len(p) :])

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out_ids

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.out_ids)


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0 or a[0] != b[0]:
        return 0
    neq = np.flatnonzero(a[:n] != b[:n])
    return int(neq[0]) if len(neq) else n


class PrefixCache:
    """KV of finished sequences, LRU-bounded by tokens; the longest prefix match is reused."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.entries: OrderedDict[int, tuple[np.ndarray, torch.Tensor, torch.Tensor]] = OrderedDict()
        self.tokens = 0
        self._ids = itertools.count()

    def add(self, tokens: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        n = len(tokens)
        if n == 0 or n > self.max_tokens:
            return
        while self.tokens + n > self.max_tokens and self.entries:
            _, (t, _, _) = self.entries.popitem(last=False)
            self.tokens -= len(t)
        self.entries[next(self._ids)] = (np.asarray(tokens, dtype=np.int64), k, v)
        self.tokens += n

    def best(self, tokens: np.ndarray) -> tuple[int, int]:
        best_key, best_len = -1, 0
        for key, (t, _, _) in self.entries.items():
            n = _lcp(t, tokens)
            if n > best_len:
                best_key, best_len = key, n
        if best_key >= 0:
            self.entries.move_to_end(best_key)
        return best_key, best_len

    def clear(self) -> None:
        self.entries.clear()
        self.tokens = 0


class Engine:
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
    ):
        """``threads``: torch threads of the scheduler thread; with ``adapt_threads`` (CPU, more
        than one thread) the count is chosen step by step between 1 and ``threads`` from measured
        step times (``cpus.ThreadGovernor``: many threads collapse when the cores are shared)."""
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
        if threads:
            torch.set_num_threads(threads)
        self._threads = threads  # None: torch's default in the main thread, 1 in a background thread
        adapt = adapt_threads and device == "cpu" and bool(threads) and threads > 1
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
        self.prefill_chunk = prefill_chunk
        self.sm = SlotModel(self.model, max_running, self.max_len)
        self.cache = PrefixCache(prefix_cache_tokens)
        self.weight_version = "default"
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.paused: str | None = None  # None | abort | retract | in_place
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
    def make_requests(
        self,
        input_ids: list[int],
        sampling: dict[str, Any] | None,
        rid: str | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
        image_data: Any = None,
    ) -> list[Request]:
        """Validate one prompt and expand ``n``; raises BadRequest naming the field."""
        if not isinstance(input_ids, list) or not input_ids:
            raise BadRequest("input_ids: must be a non-empty list of token ids")
        bad = [t for t in input_ids if not is_token_id(t, self.vocab_size)]
        if bad:
            raise BadRequest(f"input_ids: token id {bad[0]!r} outside the vocabulary [0, {self.vocab_size})")
        if len(input_ids) >= self.max_len:
            raise BadRequest(
                f"input_ids: prompt of {len(input_ids)} tokens does not fit the context length {self.max_len}"
            )
        s = Sampling.from_dict(sampling, self.vocab_size)
        if not isinstance(top_logprobs_num, int) or top_logprobs_num < 0:
            raise BadRequest(f"top_logprobs_num: must be an integer >= 0, got {top_logprobs_num!r}")
        if not isinstance(logprob_start_len, int) or logprob_start_len < -1:
            raise BadRequest(f"logprob_start_len: must be an integer >= -1, got {logprob_start_len!r}")
        if rid is not None and not isinstance(rid, str):
            raise BadRequest(f"rid: must be a string, got {type(rid).__name__}")
        rid = rid or uuid.uuid4().hex
        images, rope, delta = self._images(input_ids, image_data)
        out = []
        for i in range(s.n):
            gen = torch.Generator().manual_seed(s.sampling_seed + i) if s.sampling_seed is not None else None
            out.append(
                Request(
                    rid if s.n == 1 else f"{rid}-{i}",
                    list(input_ids),
                    s,
                    return_logprob,
                    top_logprobs_num,
                    logprob_start_len,
                    index=i,
                    gen=gen,
                    stops=frozenset(s.stop_token_ids)
                    | (frozenset() if s.ignore_eos else frozenset(self.eos_ids)),
                    images=images,
                    image_pad=self.image_pad_id if images else -1,
                    rope=rope,
                    rope_delta=delta,
                )
            )
        return out

    @property
    def image_pad_id(self) -> int:
        return int(self.model.config.image_token_id)

    def _images(self, input_ids: list[int], image_data: Any) -> tuple[list[Image], torch.Tensor | None, int]:
        """The prompt's images (SGLang's ``image_data``: base64 strings or data URLs), checked
        against its pad runs, and its multimodal rotary positions."""
        if image_data is None or image_data == []:
            if self.vision is not None and self.image_pad_id in input_ids:
                raise BadRequest("image_data: input_ids hold <|image_pad|> tokens but no image was sent")
            return [], None, 0
        if self.vision is None:
            raise BadRequest(f"image_data: {self.model_dir} is a text-only model; it takes no images")
        items = image_data if isinstance(image_data, list) else [image_data]
        spec = self.vision_spec
        if len(items) > spec.max_images:
            raise BadRequest(
                f"image_data: {len(items)} images, more than the model's {spec.max_images} per prompt"
            )
        try:
            images = [load_image(x, f"image_data[{i}]") for i, x in enumerate(items)]
            grids = [spec.grid(im) for im in images]
        except (ImageError, OSError, ValueError) as e:  # whatever the data was, the request's fault
            raise BadRequest(
                str(e) if isinstance(e, ImageError) else f"image_data: {type(e).__name__}: {e}"
            ) from None
        runs = [b - a for a, b in pad_runs(input_ids, self.image_pad_id)]
        want = [spec.num_tokens(im) for im in images]
        if runs != want:
            raise BadRequest(
                f"image_data: input_ids' <|image_pad|> runs {runs} do not match the {len(images)} "
                f"image(s), which take {want} tokens"
            )
        pos, delta = mrope_positions(input_ids, self.image_pad_id, grids, spec.merge_size)
        return images, torch.from_numpy(pos), delta

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
    def abort(self, rid: str = "", abort_all: bool = False) -> int:
        with self._control():
            n = 0
            for r in list(self.waiting) + list(self.running):
                if abort_all or r.rid == rid or r.rid.startswith(f"{rid}-") and rid:
                    self._finish(
                        r, {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
                    )
                    n += 1
            self._retire()
            self.cv.notify_all()
            return n

    def pause(self, mode: str = "abort") -> None:
        if mode not in ("abort", "retract", "in_place"):
            raise BadRequest(f"mode: must be abort, retract or in_place, got {mode!r}")
        with self._control():
            self.paused = mode
            if mode == "abort":
                self.abort(abort_all=True)
            elif mode == "retract":
                self._retract_running()

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

        files = sorted(Path(model_path).glob("*.safetensors"))
        if not files:
            raise BadRequest(f"model_path: no *.safetensors files in {model_path!r}")
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

    # ---- scheduler -------------------------------------------------------------------------------
    def _loop(self, threads: int | None = None) -> None:
        if threads:
            torch.set_num_threads(threads)  # OpenMP settings are per thread
        while True:
            with self.cv:
                while not self._stop and (self.paused is not None or not (self.waiting or self.running)):
                    self.cv.wait(timeout=0.5)
                if self._stop:
                    return
                try:
                    self.step()
                except Exception:  # noqa: BLE001 - find the request that failed, keep serving
                    log.exception("engine step failed; stepping its requests one at a time")
                    self._isolate()
            while self._waiters:  # let control calls (abort, pause, weights) in between steps
                time.sleep(0.0002)

    def run_until_idle(self) -> None:
        """Step in the calling thread until nothing is waiting or running (benchmarks, tools)."""
        while True:
            with self._control():
                if not (self.waiting or self.running) or self.paused is not None:
                    return
                self.step()

    def step(self) -> None:
        """One scheduler step (called with the lock held)."""
        self.stats["steps"] += 1
        gov = self.governor
        if gov is not None:  # probe the other thread count on decode-only steps (those are timed)
            admits = self.waiting and len(self.running) < self.max_running
            gov.pick(probe=not (admits or any(r.state == "prefill" for r in self.running)))
            t0 = time.perf_counter()
            prefilled, generated = self.stats["prefill_tokens"], self.stats["generated_tokens"]
        self._admit()
        self._prefill()
        self._decode()
        self._retire()
        if gov is not None and self.stats["prefill_tokens"] == prefilled:
            # decode-only steps are timed (per token generated): a step that also prefilled has
            # another cost per token, and comparing the two would mislead the choice
            gov.record(time.perf_counter() - t0, self.stats["generated_tokens"] - generated)

    def _retract_running(self) -> list[Request]:
        """Put every running request back at the head of the queue; its KV is recomputed when it
        is admitted again (tokens already generated are kept, as in SGLang's retraction)."""
        back = [r for r in self.running if r.state != "done"]
        for r in reversed(back):
            r.state, r.slot, r.computed, r.shared = "waiting", -1, 0, None
            r.retractions += 1
            self.waiting.appendleft(r)
        self.running = []
        return back

    def _isolate(self) -> None:
        """A batched step failed: retract its requests and step each one alone. A request that
        fails alone is finished with the error (its client gets it); the others go back to the
        queue and continue, so one bad request never aborts the batch it shared a step with."""
        suspects = self._retract_running()
        cap = self.max_running
        self.max_running = 1
        try:
            for r in suspects:
                self.waiting.remove(r)
                self.waiting.appendleft(r)
                try:
                    self.step()
                except Exception as e:  # noqa: BLE001 - this request's own failure
                    log.error("request %s failed alone: %s: %s", r.rid, type(e).__name__, e)
                    self.running = [x for x in self.running if x is not r]
                    if r in self.waiting:
                        self.waiting.remove(r)
                    r.slot = -1
                    self._finish(
                        r,
                        {
                            "type": "abort",
                            "message": f"engine error: {type(e).__name__}: {e}",
                            "status_code": 500,
                            "err_type": type(e).__name__,
                        },
                    )
                    continue
                self._retract_running()
        finally:
            self.max_running = cap

    def _blocked_by_sibling(self, toks: np.ndarray) -> bool:
        """Wait while a request still prefilling shares more of this prompt than it has computed."""
        for r in self.running:
            if r.state == "prefill":
                n = _lcp(r.prompt_arr, toks)
                if n > r.computed and n > 16:
                    return True
        return False

    def _admit(self) -> None:
        """Admit waiting requests in order; one that shares its prompt with a request still
        prefilling waits (it will be forked from it) and does not hold back the ones behind it."""
        held: list[Request] = []
        while self.waiting and len(self.running) < self.max_running:
            r = self.waiting.popleft()
            if r.state == "done":
                continue
            toks = r.prompt_arr if not r.out_ids else np.asarray(r.tokens, dtype=np.int64)
            if self._blocked_by_sibling(toks):
                held.append(r)
                continue
            r.slot = len(self.running)
            self.running.append(r)
            r.state, r.shared = "prefill", None
            match = 0
            if r.logprob_start_len < 0:  # prompt logprobs need the whole prompt computed
                best_run, best_len = None, 0
                for o in self.running[:-1]:
                    n = o.common_prefix(toks, o.computed)
                    if n > best_len:
                        best_run, best_len = o, n
                key, cache_len = self.cache.best(toks)
                match = min(max(best_len, cache_len), len(toks) - 1)
                if match > 0 and best_len >= cache_len and best_run is not None:
                    self.sm.copy_slot(best_run.slot, r.slot, match)
                    if best_run.shared is not None and best_run.shared[1] <= best_len:
                        r.shared = best_run.shared
                elif match > 0:
                    _, k, v = self.cache.entries[key]
                    self.sm.load_slot(r.slot, k[:, :, :match], v[:, :, :match])
            r.computed = r.cached_tokens = match
            self.stats["cached_tokens"] += match
            if r.logprob_start_len >= 0:
                self._input_logprobs(r)
        self.waiting.extendleft(reversed(held))

    def _input_logprobs(self, r: Request) -> None:
        ids = torch.tensor([r.prompt], device=self.device)
        kw: dict[str, Any] = {}
        if r.images:  # the HF model's own multimodal forward
            pv, grid = self.vision.pixels(r.images)
            kw = dict(
                pixel_values=pv.to(self.device),
                image_grid_thw=grid.to(self.device),
                mm_token_type_ids=(ids == r.image_pad).int(),
            )
        with torch.inference_mode():
            logits = self.model(input_ids=ids, **kw).logits[0].float().cpu()
        t = r.sampling.temperature or 1.0
        logp = torch.log_softmax(logits / t, -1)
        vals: list[float | None] = [None] + [float(logp[i - 1, r.prompt[i]]) for i in range(1, len(r.prompt))]
        r.input_logprobs = vals[r.logprob_start_len :]

    def _prefill(self) -> None:
        """Chunks of prefilling requests, up to ``prefill_chunk`` tokens, in one batched forward."""
        budget = self.prefill_chunk
        items, reqs = [], []
        for r in self.running:
            if r.state != "prefill" or budget <= 0:
                continue
            toks = r.tokens
            n = min(len(toks) - r.computed, budget)
            items.append((r.slot, toks[r.computed : r.computed + n], r.computed))
            reqs.append(r)
            budget -= n
        if not items:
            return
        if any(r.images for r in reqs):
            rope, embeds = zip(
                *(
                    self._image_inputs(r, start, len(ids))
                    for r, (_, ids, start) in zip(reqs, items, strict=True)
                ),
                strict=True,
            )
            logits = self.sm.prefill_many(items, list(rope), list(embeds))
        else:
            logits = self.sm.prefill_many(items)
        done, rows = [], []
        for i, (r, (_, ids, _)) in enumerate(zip(reqs, items, strict=True)):
            r.computed += len(ids)
            self.stats["prefill_tokens"] += len(ids)
            if r.computed == r.length:
                r.state = "decode"
                forks = self._fork(r)
                done += [r, *forks]
                rows += [i] * (1 + len(forks))
        if done:
            self._emit(done, logits[rows])

    def _image_inputs(self, r: Request, start: int, n: int) -> tuple[torch.Tensor | None, Any]:
        """The rotary positions and image embeddings of tokens start..start+n of ``r``."""
        if not r.images:
            return None, None
        end = start + n
        plen = len(r.prompt)
        rope = r.rope[:, start : min(end, plen)]
        if end > plen:  # generated tokens (a retracted request's): text positions, shifted
            tail = torch.arange(max(start, plen), end) + r.rope_delta
            rope = torch.cat([rope, tail.expand(3, -1)], 1)
        if r.features is None:
            r.features = torch.cat(self.vision.embeddings(r.images))
        pos = np.flatnonzero(np.asarray(r.prompt[start : min(end, plen)]) == r.image_pad)
        if not len(pos):
            return rope, None
        before = int(np.count_nonzero(np.asarray(r.prompt[:start]) == r.image_pad))  # pads ahead
        rows = r.features[before : before + len(pos)]
        return rope, (torch.from_numpy(pos), rows)

    def _fork(self, r: Request) -> list[Request]:
        """Start the waiting requests whose tokens equal ``r``'s (just prefilled) from a copy of its
        KV; they sample from the same logits row. All of them then share ``r``'s KV prefix."""
        forks, keep = [], deque()
        for w in self.waiting:
            if (
                len(self.running) < self.max_running
                and w.state == "waiting"
                and w.logprob_start_len < 0
                and w.length == r.length
                and w.tokens == r.tokens
                and [im.hash for im in w.images] == [im.hash for im in r.images]
            ):
                w.slot, w.state = len(self.running), "decode"
                self.running.append(w)
                self.sm.copy_slot(r.slot, w.slot, r.computed)
                w.computed = w.cached_tokens = r.computed
                self.stats["cached_tokens"] += r.computed
                forks.append(w)
            else:
                keep.append(w)
        if forks:
            self.waiting = keep
            r.shared = (next(self._share_keys), r.computed)
            for w in forks:
                w.shared = r.shared
        return forks

    def _decode(self) -> None:
        rows = [i for i, r in enumerate(self.running) if r.state == "decode" and r.finish is None]
        if not rows:
            return
        ids = [0] * len(self.running)
        pos = [0] * len(self.running)
        for i, r in enumerate(self.running):
            pos[i] = min(r.computed, self.max_len - 1)
            if r.state == "decode" and r.finish is None:
                ids[i] = r.out_ids[-1]
        shared = self._shared_prefixes()
        self.stats["shared_prefix_steps"] += shared is not None
        pos_t = torch.tensor(pos, device=self.device)
        deltas = [r.rope_delta for r in self.running]
        rope_pos = pos_t + torch.tensor(deltas, device=self.device) if any(deltas) else None
        logits = self.sm.decode(torch.tensor(ids, device=self.device), pos_t, shared, rope_pos)
        reqs = [self.running[i] for i in rows]
        for r in reqs:
            r.computed += 1
        self._emit(reqs, logits[rows] if len(rows) < len(self.running) else logits)

    def _shared_prefixes(self) -> list[tuple[int, list[int]]] | None:
        """(P, slots) per group of running requests sharing their first P KV positions, when every
        running request belongs to one and some group has several members; else None."""
        groups: dict[int, tuple[int, list[int]]] = {}
        for r in self.running:
            if r.shared is None:
                return None
            groups.setdefault(r.shared[0], (r.shared[1], []))[1].append(r.slot)
        return list(groups.values()) if len(groups) < len(self.running) else None

    def _emit(self, reqs: list[Request], logits: torch.Tensor) -> None:
        """Sample the next token of each request from its row of ``logits`` (B, V); record it and
        apply the stop rules (stop ids and EOS blocked until ``min_new_tokens``)."""
        logits = logits[:, : self.vocab_size].cpu()  # per-request seeded generators live on the host
        banned = [sorted(r.stops) if len(r.out_ids) < r.sampling.min_new_tokens else None for r in reqs]
        toks, lps, probs = sample_batch(
            logits,
            [r.sampling for r in reqs],
            [r.gen for r in reqs],
            banned,
            self._rng,
            want_probs=any(r.top_logprobs_num for r in reqs),
        )
        self.stats["generated_tokens"] += len(reqs)
        for i, (r, tok, lp) in enumerate(zip(reqs, toks, lps, strict=True)):
            s = r.sampling
            r.out_ids.append(tok)
            r.out_logprobs.append(lp)
            if r.top_logprobs_num:
                top = torch.topk(probs[i], min(r.top_logprobs_num, probs.shape[1]))
                r.out_top.append(
                    [(float(torch.log(v)), int(t)) for v, t in zip(top.values, top.indices, strict=True)]
                )
            if tok in r.stops:
                self._finish(r, {"type": "stop", "matched": tok})
            elif s.stop and (m := self._stop_string(r)) is not None:
                self._finish(r, {"type": "stop", "matched": m})
            elif len(r.out_ids) >= s.max_new_tokens or r.length >= self.max_len:
                self._finish(r, {"type": "length", "length": len(r.out_ids)})
            elif r.on_update is not None:
                r.on_update(r, False)

    def _stop_string(self, r: Request) -> str | None:
        if len(r.out_ids) < r.sampling.min_new_tokens:
            return None
        tail = self.tokenizer.decode(r.out_ids[-64:], skip_special_tokens=r.sampling.skip_special_tokens)
        for st in r.sampling.stop:
            if st in tail:
                return st
        return None

    def _finish(self, r: Request, reason: dict[str, Any]) -> None:
        if r.finish is not None:
            return
        r.finish, r.state, r.finished_at = reason, "done", time.time()
        r.weight_version = self.weight_version
        if r.on_update is not None:
            r.on_update(r, True)

    def _retire(self) -> None:
        """Drop finished requests, keeping slots 0..R-1 contiguous: each freed slot is refilled by
        the last running request (one KV copy per finished request, not a shift of all of them)."""
        for r in self.running:
            if r.state == "done" and r.computed > 0 and r.finish and r.finish["type"] != "abort":
                k, v = self.sm.save_slot(r.slot, r.computed)
                self.cache.add(r.key_tokens(r.computed), k, v)
        running = self.running
        i = 0
        while i < len(running):
            if running[i].state != "done":
                i += 1
                continue
            last = running.pop()
            if i < len(running):  # the finished one was not the last: the last takes its slot
                running[i] = last
                if last.state != "done":
                    self.sm.copy_slot(last.slot, i, last.computed)
                    last.slot = i
        self.running = running
        self.waiting = deque(r for r in self.waiting if r.state != "done")


def checkpoint_tensors(model: Any) -> dict[str, torch.Tensor]:
    """The model's tensors under the names its checkpoint (and a weight push) uses: parameters,
    buffers, a tied ``lm_head.weight``, each expert of an MoE layer on its own (a view)."""
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    if "lm_head.weight" not in params and getattr(model.config, "tie_word_embeddings", False):
        params["lm_head.weight"] = model.get_output_embeddings().weight
    return unstack_experts(params)
