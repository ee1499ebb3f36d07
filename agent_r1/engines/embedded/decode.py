"""The embedded engine's decode: one token for every running request (a group's shared prompt
attended once for all its samples), sampling and the stop rules, and retiring finished requests
(their KV into the prefix cache, the slots kept contiguous). A mixin of ``Engine``."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import torch

from agent_r1.engines.embedded.requests import Request
from agent_r1.engines.embedded.sampling import sample_batch


class Decoder:
    """Decode, emit and retire of ``Engine``."""

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
        running request belongs to one and some group has several members; else None. Never in a
        batch-invariant engine: cascade attention merges two partial softmaxes, so a request's bits
        would depend on who shares its prefix."""
        if self.sm.batch_invariant:
            return None
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
