"""The embedded engine's scheduler: the loop, and each step's admission (reusing the longest cached
or running prefix), chunked prefill under a token budget and the forks of a group's other samples;
a failed batched step is retried one request at a time. A mixin of ``Engine`` (its state: the
queues, the slot model, the cache, the lock), as ``decode.Decoder`` is."""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

import numpy as np
import torch

from agent_r1.engines.embedded.requests import Request, common_prefix_len

log = logging.getLogger("agent_r1.engine")


class Scheduler:
    """Admission, prefill and the step loop of ``Engine``."""

    def _loop(self, threads: int | None = None) -> None:
        if threads:
            torch.set_num_threads(threads)  # OpenMP settings are per thread
        while True:
            with self.cv:
                while not self._stop and not self._has_work():
                    t0 = time.perf_counter()
                    self.cv.wait(timeout=0.5)
                    self.stats["idle_s"] += time.perf_counter() - t0
                if self._stop:
                    return
                try:
                    self.step()
                except Exception:  # noqa: BLE001 - find the request that failed, keep serving
                    log.exception("engine step failed; stepping its requests one at a time")
                    self._isolate()
            while self._waiters:  # let control calls (abort, pause, weights) in between steps
                time.sleep(0.0002)

    def _has_work(self) -> bool:
        """Something to step: running requests (only those while draining for a weight update:
        nothing new is admitted), or waiting ones when not paused."""
        if self.paused == "drain":
            return bool(self.running)
        return self.paused is None and bool(self.waiting or self.running)

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
                n = common_prefix_len(r.prompt_arr, toks)
                if n > r.computed and n > 16:
                    return True
        return False

    def _admit(self) -> None:
        """Admit waiting requests in order; one that shares its prompt with a request still
        prefilling waits (it will be forked from it) and does not hold back the ones behind it."""
        held: list[Request] = []
        while self.waiting and len(self.running) < self.max_running and self.paused is None:
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
