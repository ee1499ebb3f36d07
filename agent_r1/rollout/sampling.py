"""SGLang ``sampling_params``: validation (unknown keys and bad values name the field) and the
per-request sampler. Logprob = log_softmax(logits / T) of the sampled token *before* top-k/top-p/
min-p truncation (SGLang's meaning); T = 0 is greedy with log_softmax(logits)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


class BadRequest(ValueError):
    """Invalid request input; the message names the field (HTTP 400)."""


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
        d = dict(d or {})
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(d) - known)
        if unknown:
            raise BadRequest(
                f"sampling_params: unknown field `{unknown[0]}`, expected one of {sorted(known)}"
            )
        if isinstance(d.get("stop"), str):
            d["stop"] = [d["stop"]]
        if d.get("top_k") is not None and d["top_k"] >= 1 << 30:
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
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            bad("temperature", "must be a number >= 0")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            bad("top_k", "must be -1 (off) or >= 1")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if not isinstance(self.stop, list) or not all(isinstance(x, str) and x for x in self.stop):
            bad("stop", "must be a non-empty string or a list of them")
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(t, int) and 0 <= t < vocab_size for t in self.stop_token_ids
        ):
            bad("stop_token_ids", f"must be token ids in [0, {vocab_size})")
        if self.sampling_seed is not None and not isinstance(self.sampling_seed, int):
            bad("sampling_seed", "must be an integer")


def sample_batch(
    logits: torch.Tensor,
    params: list[Sampling],
    gens: list[torch.Generator | None],
    banned: list[list[int] | None],
    shared: torch.Generator,
) -> tuple[list[int], list[float], torch.Tensor]:
    """Sample one token per row of ``logits`` (B, V) with per-row settings.

    Draws use inverse-CDF sampling (a binary search of one uniform per row), the uniform taken from
    the request's own generator when it has a ``sampling_seed`` (reproducible whatever else is in
    the batch). Returns tokens, their logprobs under softmax(logits / T) before truncation, and
    those probabilities (B, V) for top-logprob reporting.
    """
    B = logits.shape[0]
    if any(b for b in banned):
        logits = logits.clone()
        for i, b in enumerate(banned):
            if b:
                logits[i, b] = float("-inf")
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype)
    greedy = temps == 0
    probs = torch.softmax(logits / torch.where(greedy, 1.0, temps).unsqueeze(1), -1)
    toks = logits.argmax(-1)
    if not bool(greedy.all()):
        draw = probs
        trunc = [
            i
            for i, p in enumerate(params)
            if p.temperature > 0 and (p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0)
        ]
        if trunc:
            draw = probs.clone()
            for i in trunc:
                draw[i] = _truncate(draw[i], params[i])
        u = torch.rand(B, 1, generator=shared, dtype=probs.dtype)
        for i in range(B):
            if gens[i] is not None:
                u[i, 0] = torch.rand(1, generator=gens[i], dtype=probs.dtype)[0]
        cdf = draw.cumsum(-1)
        target = u.clamp(min=1e-12) * cdf[:, -1:]
        drawn = torch.searchsorted(cdf, target).squeeze(1).clamp(max=probs.shape[1] - 1)
        toks = torch.where(greedy, toks, drawn)
    lps = torch.log(probs.gather(1, toks.unsqueeze(1)).squeeze(1))
    return toks.tolist(), lps.tolist(), probs


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
