"""Policy losses on flat packed token streams with segment ids (no padding, no loops).

Every tensor is (N,) over the action tokens of a micro-batch; ``seg`` maps a token to its
segment (a step's action for StepPO/GSPO) and ``mask`` is False for tokens the policy did not
sample. Masked tokens contribute exactly 0 (``where``, not multiplication, so a NaN there cannot
leak), and an empty mask gives a zero loss with zero gradient.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from agent_r1.algos.segments import segment_sum
from agent_r1.registry import Registry

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
KL_ESTIMATORS = ("k1", "k2", "k3")


# what a setting left unset (None) becomes when neither the config nor the loss's registry entry
# gives it
BASE_SETTINGS = {"clip_low": 0.2, "clip_high": 0.2, "clip_c": 3.0, "agg": "token-mean"}


@dataclass
class LossConfig:
    """``algorithm.policy``. None = unset: the loss's own setting (``POLICY_LOSSES``), else
    ``BASE_SETTINGS``; the config resolves it once, so every consumer sees concrete values."""

    clip_low: float | None = None  # ratio clipped to [1 - clip_low, 1 + clip_high]
    clip_high: float | None = None
    clip_c: float | None = None  # dual-clip bound for A < 0 (token-ratio losses); 0 = off
    agg: str | None = None
    kl_coef: float = 0.0  # KL to the reference policy, added to the loss
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0  # entropy bonus (subtracted)
    # the decoupled objective's truncated behaviour weight min(pi_prox / mu, tis_cap) (rollout/learner
    # mismatch, stale rollouts); None: unset (on with 2.0 for async rollouts), 0: off
    tis_cap: float | None = None
    log_ratio_clamp: float = 20.0

    def __post_init__(self) -> None:  # an unset (None) setting is checked once it is resolved
        if (self.clip_low is not None and not 0 <= self.clip_low < 1) or (
            self.clip_high is not None and self.clip_high < 0
        ):
            raise ValueError(
                f"loss.clip_low must be in [0, 1) and clip_high >= 0, got {self.clip_low}, {self.clip_high}"
            )
        if self.clip_c is not None and self.clip_c != 0 and self.clip_c <= 1:
            raise ValueError(f"loss.clip_c must be > 1 (or 0: off), got {self.clip_c}")
        if self.agg is not None and self.agg not in AGG_MODES:
            raise ValueError(f"loss.agg must be one of {AGG_MODES}, got {self.agg!r}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"loss.kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}")
        if self.tis_cap is not None and self.tis_cap < 0:
            raise ValueError(f"loss.tis_cap must be > 0, 0 (off) or null, got {self.tis_cap}")


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
    """A loss and its hyper-parameters: ``defaults`` fill what a config leaves unset (an explicit
    setting wins); ``forced`` settings are part of the loss's definition (a config that sets them
    otherwise is an error). The only place these values live."""

    fn: PolicyLossFn  # (inputs, advantages, cfg) -> per-token loss, metrics
    defaults: dict[str, Any] = field(default_factory=dict)
    forced: dict[str, Any] = field(default_factory=dict)
    ratio_level: str = "token"  # token | segment (a sequence ratio per step): the behaviour weight's too


POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")


def _clip_objective(adv: torch.Tensor, ratio: torch.Tensor, cfg: LossConfig, mask: torch.Tensor, dual: bool):
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    pg = torch.maximum(pg1, pg2)
    metrics = {"clipfrac": _masked_mean((pg2 > pg1).to(adv.dtype), mask)}
    if dual and cfg.clip_c:
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


def behaviour_weight(x: LossInputs, cap: float, level: str) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled PPO's truncated behaviour weight w = min(pi_prox / mu, cap), detached: pi_prox the
    learner's recomputed logprobs (``old_logprobs``), mu the engine's sampled ones
    (``rollout_logprobs``). Per token, or per segment for sequence-ratio losses (StepPO, PSPO, GSPO:
    the step's length-normalised ratio exp(mean_t log pi_prox/mu), broadcast over its tokens).
    Metrics: the mean weight and the fraction of tokens the cap truncated."""
    lr = torch.where(x.mask, x.old_logprobs - x.rollout_logprobs, torch.zeros_like(x.old_logprobs)).detach()
    if level == "segment":
        count = segment_sum(x.mask.to(lr.dtype), x.seg, x.num_segments).clamp(min=1)
        lr = (segment_sum(lr, x.seg, x.num_segments) / count)[x.seg]
    raw = torch.exp(lr.clamp(-20, 20))
    w = raw.clamp(max=cap)
    return w, {
        "tis/weight_mean": _masked_mean(w, x.mask),
        "tis/truncated_fraction": _masked_mean((raw > cap).to(w.dtype), x.mask),
    }


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


STEP_AGG = {"agg": "seq-mean-token-mean"}  # one step's action = one sequence (StepPO)
POLICY_LOSSES.register("ppo")(PolicyLoss(ppo_clip))
# GSPO's sequence ratio is ~1 +- 1e-3: its paper's clip (3e-4 / 4e-4); no dual clip (as verl)
POLICY_LOSSES.register("gspo")(
    PolicyLoss(gspo, defaults={"clip_low": 3e-4, "clip_high": 4e-4}, ratio_level="segment")
)
# StepPO: the GSPO ratio per agent step, seq-mean-token-mean; verl's default clip (0.2), which the
# seed's scripts do not override
POLICY_LOSSES.register("steppo")(PolicyLoss(gspo, forced=STEP_AGG, ratio_level="segment"))
# PSPO (PaperScout's script): StepPO with clip 3e-4 / 4e-4 and clip_ratio_c 10
POLICY_LOSSES.register("pspo")(
    PolicyLoss(
        gspo,
        defaults={"clip_low": 3e-4, "clip_high": 4e-4, "clip_c": 10.0},
        forced=STEP_AGG,
        ratio_level="segment",
    )
)
POLICY_LOSSES.register("reinforce")(PolicyLoss(reinforce))
POLICY_LOSSES.register("grpo")(PolicyLoss(ppo_clip, defaults={"clip_high": 0.28}))  # DAPO's clip-higher
POLICY_LOSSES.register("opd")(PolicyLoss(ppo_clip))  # advantages from the `opd` estimator
POLICY_LOSSES.register("sft")(PolicyLoss(nll, forced={"agg": "token-mean"}))


class LossSettingConflict(ValueError):
    """A config sets what the chosen loss forces to another value."""


def resolve_loss_settings(name: str, given: dict[str, Any]) -> dict[str, Any]:
    """The loss's settings for a config that sets ``given``: its defaults fill what ``given``
    leaves unset, ``given`` wins, and ``given`` contradicting a forced setting raises, naming both."""
    spec = POLICY_LOSSES.get(name)
    for key, value in spec.forced.items():
        if key in given and given[key] != value:
            raise LossSettingConflict(
                f"algorithm.policy.{key}={given[key]} conflicts with algorithm.loss={name}, which "
                f"requires {key}={value} (drop the setting or choose another loss)"
            )
    return {**spec.defaults, **given, **spec.forced}


def loss_config(name: str, **overrides: Any) -> LossConfig:
    """The loss's settings with ``overrides`` on top (see ``resolve_loss_settings``), complete."""
    return complete(name, LossConfig(**resolve_loss_settings(name, overrides)))


def complete(name: str, cfg: LossConfig) -> LossConfig:
    """``cfg`` with every unset (None) setting filled: the loss's own, else ``BASE_SETTINGS``."""
    spec = POLICY_LOSSES.get(name)
    own = {**BASE_SETTINGS, **spec.defaults, **spec.forced}
    unset = {k: v for k, v in own.items() if getattr(cfg, k) is None}
    return dataclasses.replace(cfg, **unset) if unset else cfg


def policy_loss(
    name: str, x: LossInputs, cfg: LossConfig | None = None, denom: float | None = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """Scalar loss to minimise and its metrics (``cfg``: resolved settings, default the loss's own)."""
    spec = POLICY_LOSSES.get(name)
    cfg = complete(name, cfg) if cfg is not None else loss_config(name)
    adv = torch.where(x.mask, x.advantages, torch.zeros_like(x.advantages)).detach()
    metrics: dict[str, float] = {}
    if x.rollout_logprobs is not None:
        diff = (x.old_logprobs - x.rollout_logprobs).detach()
        metrics["mismatch/abs_logprob_diff"] = _masked_mean(diff.abs(), x.mask)
    pg, m = spec.fn(x, adv, cfg)
    metrics.update(m)
    if cfg.tis_cap and x.rollout_logprobs is not None:  # the decoupled objective (0 / None: off)
        w, m = behaviour_weight(x, cfg.tis_cap, spec.ratio_level)
        pg = pg * w
        metrics.update(m)
    agg = cfg.agg
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
    "behaviour_weight",
    "kl_penalty",
    "loss_config",
    "policy_loss",
    "resolve_loss_settings",
]
