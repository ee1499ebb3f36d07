"""SGLang ``sampling_params``: validation (unknown keys and bad values name the field) and the
per-request sampler. Logprob = log_softmax(logits / T) of the sampled token *before* top-k/top-p/
min-p truncation (SGLang's meaning); T = 0 is greedy with log_softmax(logits)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from agent_r1 import native
from agent_r1.http_service import BadRequest
from agent_r1.rollout.protocol import GREEDY_BELOW

SEED_LIMIT = (1 << 63) - 128  # seed + sample index (n <= 128) still seeds a torch.Generator


def is_token_id(t: Any, vocab_size: int) -> bool:
    """An int (not a bool: JSON true/false would pass ``isinstance(t, int)``) in [0, vocab_size)."""
    return isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size


@dataclass
class Sampling:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    sampling_seed: int | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None, vocab_size: int) -> Sampling:
        if d is not None and not isinstance(d, dict):
            raise BadRequest(f"sampling_params: must be an object, got {type(d).__name__}")
        d = dict(d or {})
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(d) - known)
        if unknown:
            raise BadRequest(
                f"sampling_params: unknown field `{unknown[0]}`, expected one of {sorted(known)}"
            )
        if isinstance(d.get("stop"), str):
            d["stop"] = [d["stop"]]
        top_k = d.get("top_k")
        if isinstance(top_k, int) and not isinstance(top_k, bool) and top_k >= 1 << 30:
            d["top_k"] = -1
        s = cls(**{k: v for k, v in d.items() if v is not None})
        s.validate(vocab_size)
        return s

    def validate(self, vocab_size: int) -> None:
        def bad(name: str, msg: str) -> None:
            raise BadRequest(f"sampling_params.{name}: {msg}, got {getattr(self, name)!r}")

        for name in ("max_new_tokens", "min_new_tokens", "n", "top_k"):
            if not isinstance(getattr(self, name), int) or isinstance(getattr(self, name), bool):
                bad(name, "must be an integer")
        if self.max_new_tokens < 0:
            bad("max_new_tokens", "must be >= 0")
        if self.min_new_tokens < 0:
            bad("min_new_tokens", "must be >= 0")
        if not 1 <= self.n <= 128:
            bad("n", "must be in [1, 128]")
        for name in ("temperature", "top_p", "min_p"):  # NaN and inf fail every range check below
            x = getattr(self, name)
            if not isinstance(x, (int, float)) or isinstance(x, bool) or not math.isfinite(x):
                bad(name, "must be a finite number")
        if self.temperature < 0:
            bad("temperature", "must be a number >= 0")
        if self.temperature < GREEDY_BELOW:  # as SGLang: a vanishing temperature is greedy
            self.temperature = 0.0
        if not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            bad("top_k", "must be -1 (off) or >= 1")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if not isinstance(self.stop, list) or not all(isinstance(x, str) and x for x in self.stop):
            bad("stop", "must be a non-empty string or a list of them")
        if not isinstance(self.stop_token_ids, list) or not all(
            is_token_id(t, vocab_size) for t in self.stop_token_ids
        ):
            bad("stop_token_ids", f"must be token ids in [0, {vocab_size})")
        if self.sampling_seed is not None and (
            not isinstance(self.sampling_seed, int)
            or isinstance(self.sampling_seed, bool)
            or not 0 <= self.sampling_seed < SEED_LIMIT
        ):
            bad("sampling_seed", f"must be an integer in [0, {SEED_LIMIT})")


def sample_batch(
    logits: torch.Tensor,
    params: list[Sampling],
    gens: list[torch.Generator | None],
    banned: list[list[int] | None],
    shared: torch.Generator,
    want_probs: bool = False,
) -> tuple[list[int], list[float], torch.Tensor | None]:
    """Sample one token per row of ``logits`` (B, V) with per-row settings.

    Draws use inverse-CDF sampling (a binary search of one uniform per row), the uniform taken from
    the request's own generator when it has a ``sampling_seed`` (reproducible whatever else is in
    the batch). Returns tokens, their logprobs under softmax(logits / T) before truncation, and
    (``want_probs``) those probabilities (B, V) for top-logprob reporting. Three passes over the
    logits (max, exp, cumulative sum): the softmax is never normalised as a whole. Logits may be
    float32 or bf16 (read as float32); on a CPU, batches without truncation, banned tokens or
    top logprobs run as one native pass per row (``agent_r1/native/sample.cpp``), the same draws.
    """
    B = logits.shape[0]
    temps = [p.temperature for p in params]
    sampled = [i for i, t in enumerate(temps) if t > 0]
    plain = not want_probs and not any(banned) and not any(_truncates(params[i]) for i in sampled)
    kernel = _kernel(logits) if plain else None
    if kernel is not None:
        u = _uniforms(B, gens, shared) if sampled else torch.zeros(B, 1)
        temp = torch.tensor([t or 1.0 for t in temps], dtype=torch.float32)
        greedy = torch.tensor([t == 0 for t in temps], dtype=torch.uint8)
        toks, lps = torch.empty(B, dtype=torch.int64), torch.empty(B, dtype=torch.float32)
        native.call(kernel, logits, logits.stride(0), B, logits.shape[1], temp, greedy, u, toks, lps)
        return toks.tolist(), lps.tolist(), None
    logits = logits.float()
    if any(b for b in banned):
        logits = logits.clone()
        for i, b in enumerate(banned):
            if b:
                logits[i, b] = float("-inf")
    z = logits
    if any(t not in (0, 1) for t in temps):  # greedy rows report log_softmax(logits): T = 1
        z = logits / torch.tensor([t or 1.0 for t in temps], dtype=logits.dtype).unsqueeze(1)
    m = z.amax(-1, keepdim=True)
    e = torch.exp(z - m)
    if sampled:
        cdf = e.cumsum(-1)
        total = cdf[:, -1:]
        trunc = [i for i in sampled if _truncates(params[i])]
        draw_cdf = cdf
        if trunc:
            draw_cdf = cdf.clone()
            for i in trunc:
                draw_cdf[i] = _truncate(e[i], params[i]).cumsum(-1)
        u = _uniforms(B, gens, shared)
        target = u.clamp(min=1e-12) * draw_cdf[:, -1:]
        toks = torch.searchsorted(draw_cdf, target).squeeze(1).clamp(max=logits.shape[1] - 1)
        if len(sampled) < B:
            toks = torch.where(torch.tensor([t == 0 for t in temps]), logits.argmax(-1), toks)
    else:
        total = e.sum(-1, keepdim=True)
        toks = logits.argmax(-1)
    lps = (z.gather(1, toks.unsqueeze(1)) - m - torch.log(total)).squeeze(1)
    return toks.tolist(), lps.tolist(), (e / total if want_probs else None)


def _uniforms(B: int, gens: list[torch.Generator | None], shared: torch.Generator) -> torch.Tensor:
    """(B, 1) float32 uniforms: from the request's own generator where it has a seed."""
    u = torch.rand(B, 1, generator=shared, dtype=torch.float32)
    for i in range(B):
        if gens[i] is not None:
            u[i, 0] = torch.rand(1, generator=gens[i], dtype=torch.float32)[0]
    return u


def _truncates(s: Sampling) -> bool:
    return s.top_k > 0 or s.top_p < 1.0 or s.min_p > 0


def _kernel(logits: torch.Tensor):
    """The native sampler for these logits (CPU, float32 or bf16, rows of unit stride), or None."""
    if logits.device.type != "cpu" or logits.stride(-1) != 1:
        return None
    return _sampler(logits.dtype)


@functools.cache
def _sampler(dtype: torch.dtype):
    return native.function("sample", "agent_r1_sample", dtype, "p i64 i32 i32 p p p p p")


def _truncate(probs: torch.Tensor, s: Sampling) -> torch.Tensor:
    if s.top_k > 0 and s.top_k < probs.numel():
        kth = torch.topk(probs, s.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, 0.0)
    if s.top_p < 1.0:
        sp, idx = torch.sort(probs, descending=True)
        keep = (torch.cumsum(sp, 0) - sp) < s.top_p * sp.sum()
        probs = torch.zeros_like(probs).index_copy_(0, idx, torch.where(keep, sp, 0.0))
    if s.min_p > 0:
        probs = torch.where(probs >= s.min_p * probs.max(), probs, 0.0)
    return probs
