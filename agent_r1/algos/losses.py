"""Policy losses on flat packed token streams with segment ids (no padding, no loops).

Every tensor is (N,) over the action tokens of a micro-batch; ``seg`` maps a token to its
segment (a step's action for StepPO/GSPO) and ``mask`` is False for tokens the policy did not
sample. Masked tokens contribute exactly 0 (``where``, not multiplication, so a NaN there cannot
leak), and an empty mask gives a zero loss with zero gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from agent_r1.algos.segments import segment_sum
from agent_r1.registry import Registry

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
KL_ESTIMATORS = ("k1", "k2", "k3")


@dataclass
class LossConfig:
    clip_low: float = 0.2  # ratio clipped to [1 - clip_low, 1 + clip_high]
    clip_high: float = 0.2
    clip_c: float | None = 3.0  # dual-clip bound for A < 0 (None: off)
    agg: str = "token-mean"
    kl_coef: float = 0.0  # KL to the reference policy, added to the loss
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0  # entropy bonus (subtracted)
    tis_cap: float | None = None  # truncated importance sampling for rollout/learner mismatch
    log_ratio_clamp: float = 20.0
    opd_clamp: float = 10.0

    def __post_init__(self) -> None:
        if self.clip_low < 0 or self.clip_high < 0 or self.clip_low >= 1:
            raise ValueError(
                f"loss.clip_low must be in [0, 1) and clip_high >= 0, got {self.clip_low}, {self.clip_high}"
            )
        if self.clip_c is not None and self.clip_c <= 1:
            raise ValueError(f"loss.clip_c must be > 1 (or null), got {self.clip_c}")
        if self.agg not in AGG_MODES:
            raise ValueError(f"loss.agg must be one of {AGG_MODES}, got {self.agg!r}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"loss.kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}")
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ValueError(f"loss.tis_cap must be > 0 (or null), got {self.tis_cap}")


@dataclass
class LossInputs:
    logprobs: torch.Tensor  # (N,) current policy, requires grad
    old_logprobs: torch.Tensor  # (N,) learner logprobs of the behaviour policy
    advantages: torch.Tensor  # (N,) per token (a step's advantage broadcast over its tokens)
    mask: torch.Tensor  # (N,) bool
    seg: torch.Tensor  # (N,) int64 segment id
    num_segments: int
    ref_logprobs: torch.Tensor | None = None  # (N,) for the KL term
    rollout_logprobs: torch.Tensor | None = None  # (N,) as sampled by the engine (mismatch / TIS)
    entropy: torch.Tensor | None = None  # (N,) for the entropy bonus
    teacher_logprobs: torch.Tensor | None = None  # (N,) OPD


def aggregate(
    x: torch.Tensor,
    mask: torch.Tensor,
    seg: torch.Tensor,
    num_segments: int,
    mode: str,
    denom: float | None = None,
) -> torch.Tensor:
    """Reduce per-token values to a scalar: the masked sum (per segment, for the seq-mean modes)
    over a count of tokens with mask 1 (token-mean) or of segments with at least one such token.
    The count is local unless ``denom`` gives it: data-parallel learners pass the global count
    divided by the number of ranks (gradients are averaged over ranks), so the loss is the
    global mean. A count of 0 divides by 1 (the sum is 0 then)."""
    v = torch.where(mask, x, torch.zeros_like(x))
    if mode == "token-mean":
        n = float(mask.sum()) if denom is None else denom
        return v.sum() / (n if n > 0 else 1.0)
    per_seg = segment_sum(v, seg, num_segments)
    count = segment_sum(mask.to(x.dtype), seg, num_segments)
    if mode == "seq-mean-token-mean":
        per_seg = per_seg / count.clamp(min=1)
    elif mode != "seq-mean-token-sum":
        raise ValueError(f"aggregation mode must be one of {AGG_MODES}, got {mode!r}")
    n = float((count > 0).sum()) if denom is None else denom
    return per_seg.sum() / (n if n > 0 else 1.0)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL(pi || ref) estimates: k1 = log r, k2 = (log r)^2 / 2, k3 = e^{-log r} - 1 + log r
    (log r = logpi - logref; k3 is the non-negative low-variance estimator, clamped to [-10, 10])."""
    lr = logprobs - ref_logprobs
    if estimator == "k1":
        return lr
    if estimator == "k2":
        return 0.5 * lr**2
    if estimator == "k3":
        return (torch.exp(-lr.clamp(-20, 20)) - 1 + lr).clamp(-10, 10)
    raise ValueError(f"kl estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    n = int(mask.sum())
    return float(torch.where(mask, x, torch.zeros_like(x)).sum()) / n if n else 0.0


PolicyLossFn = Callable[[LossInputs, torch.Tensor, LossConfig], tuple[torch.Tensor, dict[str, float]]]


@dataclass(frozen=True)
class PolicyLoss:
    fn: PolicyLossFn  # (inputs, advantages, cfg) -> per-token loss, metrics
    agg: str | None = None  # forced aggregation mode (StepPO/PSPO), else cfg.agg
    defaults: dict[str, Any] = field(default_factory=dict)


POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")


def _clip_objective(adv: torch.Tensor, ratio: torch.Tensor, cfg: LossConfig, mask: torch.Tensor, dual: bool):
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    pg = torch.maximum(pg1, pg2)
    metrics = {"clipfrac": _masked_mean((pg2 > pg1).to(adv.dtype), mask)}
    if dual and cfg.clip_c is not None:
        pg3 = -adv * cfg.clip_c
        pg_dual = torch.minimum(pg, pg3)
        metrics["dual_clipfrac"] = _masked_mean(((adv < 0) & (pg > pg3)).to(adv.dtype), mask)
        pg = torch.where(adv < 0, pg_dual, pg)
    return pg, metrics


def ppo_clip(x: LossInputs, adv: torch.Tensor, cfg: LossConfig):
    """Token ratio rho = exp(logpi - logpi_old); max(-A rho, -A clip(rho)); dual-clip min(., -A c) for A < 0."""
    log_ratio = torch.where(x.mask, x.logprobs - x.old_logprobs, torch.zeros_like(x.logprobs)).clamp(
        -cfg.log_ratio_clamp, cfg.log_ratio_clamp
    )
    ratio = torch.exp(log_ratio)
    pg, m = _clip_objective(adv, ratio, cfg, x.mask, dual=True)
    return pg, {**m, **_ratio_metrics(ratio, log_ratio, x.mask)}


def gspo(x: LossInputs, adv: torch.Tensor, cfg: LossConfig):
    """Sequence ratio s = exp(mean_t(logpi - logpi_old)) over each segment's sampled tokens (the
    geometric mean of token ratios); per token s_t = sg(s) pi/sg(pi); max(-A s_t, -A clip(s_t))."""
    lr = torch.where(x.mask, x.logprobs - x.old_logprobs, torch.zeros_like(x.logprobs))
    count = segment_sum(x.mask.to(lr.dtype), x.seg, x.num_segments).clamp(min=1)
    seq_lr = segment_sum(lr, x.seg, x.num_segments) / count
    log_s = (seq_lr.detach()[x.seg] + x.logprobs - x.logprobs.detach()).clamp(max=10.0)
    s = torch.exp(torch.where(x.mask, log_s, torch.zeros_like(log_s)))
    pg, m = _clip_objective(adv, s, cfg, x.mask, dual=False)
    return pg, {**m, **_ratio_metrics(s, lr, x.mask)}


def reinforce(x: LossInputs, adv: torch.Tensor, cfg: LossConfig):
    """-A log pi (on-policy; no ratio)."""
    return -adv * x.logprobs, {}


def nll(x: LossInputs, adv: torch.Tensor, cfg: LossConfig):
    """Supervised fine-tuning (warm start): -log pi of the demonstrated tokens."""
    return -x.logprobs, {}


def _ratio_metrics(ratio: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    if not mask.any():
        return {"ratio/mean": 1.0, "ratio/max": 1.0, "ratio/min": 1.0, "approx_kl": 0.0}
    r = ratio.detach()[mask]
    lr = log_ratio.detach()[mask]
    return {
        "ratio/mean": float(r.mean()),
        "ratio/max": float(r.max()),
        "ratio/min": float(r.min()),
        "approx_kl": float((torch.exp(-lr) - 1 + lr).mean()),  # k3 estimate of KL(old || new)
    }


POLICY_LOSSES.register("ppo")(PolicyLoss(ppo_clip))
POLICY_LOSSES.register("gspo")(PolicyLoss(gspo))
POLICY_LOSSES.register("steppo")(PolicyLoss(gspo, agg="seq-mean-token-mean"))
POLICY_LOSSES.register("pspo")(
    PolicyLoss(
        gspo, agg="seq-mean-token-mean", defaults={"clip_low": 3e-4, "clip_high": 4e-4, "clip_c": 10.0}
    )
)
POLICY_LOSSES.register("reinforce")(PolicyLoss(reinforce))
POLICY_LOSSES.register("grpo")(PolicyLoss(ppo_clip))
POLICY_LOSSES.register("opd")(PolicyLoss(ppo_clip))
POLICY_LOSSES.register("sft")(PolicyLoss(nll, agg="token-mean"))


def resolved_agg(name: str, cfg: LossConfig) -> str:
    """The aggregation mode loss ``name`` uses: its forced mode (StepPO/PSPO), else ``cfg.agg``."""
    return POLICY_LOSSES.get(name).agg or cfg.agg


def loss_config(name: str, **overrides: Any) -> LossConfig:
    """The loss's defaults (e.g. PSPO's tight clip) with ``overrides`` on top."""
    return LossConfig(**{**POLICY_LOSSES.get(name).defaults, **overrides})


def policy_loss(
    name: str, x: LossInputs, cfg: LossConfig | None = None, denom: float | None = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """Scalar loss to minimise and its metrics. OPD derives its advantages from the teacher:
    A_t = -clamp(logpi_old - logpi_teacher, +-c)."""
    spec = POLICY_LOSSES.get(name)
    cfg = cfg or loss_config(name)
    adv = x.advantages
    if name == "opd":
        if x.teacher_logprobs is None:
            raise ValueError("policy loss 'opd' needs teacher_logprobs")
        adv = -(x.old_logprobs - x.teacher_logprobs).clamp(-cfg.opd_clamp, cfg.opd_clamp)
    adv = torch.where(x.mask, adv, torch.zeros_like(adv)).detach()
    metrics: dict[str, float] = {}
    if x.rollout_logprobs is not None:
        diff = (x.old_logprobs - x.rollout_logprobs).detach()
        metrics["mismatch/abs_logprob_diff"] = _masked_mean(diff.abs(), x.mask)
    pg, m = spec.fn(x, adv, cfg)
    metrics.update(m)
    if cfg.tis_cap is not None and x.rollout_logprobs is not None:
        w = torch.exp((x.old_logprobs - x.rollout_logprobs).clamp(-20, 20)).clamp(max=cfg.tis_cap).detach()
        pg = pg * w
        metrics["tis/weight_mean"] = _masked_mean(w, x.mask)
    agg = resolved_agg(name, cfg)
    loss = aggregate(pg, x.mask, x.seg, x.num_segments, agg, denom)
    metrics["loss/pg"] = float(loss.detach())
    if cfg.kl_coef:
        if x.ref_logprobs is None:
            raise ValueError("loss.kl_coef > 0 needs ref_logprobs")
        kl = aggregate(
            kl_penalty(x.logprobs, x.ref_logprobs, cfg.kl_estimator),
            x.mask,
            x.seg,
            x.num_segments,
            agg,
            denom,
        )
        loss = loss + cfg.kl_coef * kl
        metrics["loss/kl"] = float(kl.detach())
    if x.entropy is not None:
        metrics["entropy"] = _masked_mean(x.entropy.detach(), x.mask)
    if cfg.entropy_coef:
        if x.entropy is None:
            raise ValueError("loss.entropy_coef > 0 needs entropy")
        ent = aggregate(x.entropy, x.mask, x.seg, x.num_segments, agg, denom)
        loss = loss - cfg.entropy_coef * ent
    metrics["loss/total"] = float(loss.detach())
    return loss, metrics


__all__ = [
    "AGG_MODES",
    "POLICY_LOSSES",
    "LossConfig",
    "LossInputs",
    "aggregate",
    "kl_penalty",
    "loss_config",
    "policy_loss",
    "resolved_agg",
]
