"""Advantage estimators (registry). Pure functions on flat step streams; groups span ranks.

Steps arrive ordered by trajectory then step index: ``traj`` (S,) are contiguous trajectory
indices, ``group_key`` (T,) the prompt group of each trajectory. Outputs are per step
(``step_adv``, ``step_ret``) or, for token-level estimators, per action token. Zero-variance and
size-1 groups give 0, never NaN.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from agent_r1.algos.reduce import LocalReducer, Reducer
from agent_r1.algos.segments import group_stats, reverse_scan, segment_ends, segment_sum, whiten
from agent_r1.registry import Registry


@dataclass
class TokenInputs:
    step: torch.Tensor  # (N,) int64 step index of each action token (steps in order)
    mask: torch.Tensor  # (N,) bool, True = sampled by the policy
    logprobs: torch.Tensor | None = None  # (N,) rollout/old logprobs
    values: torch.Tensor | None = None  # (N,) critic values per token
    teacher_logprobs: torch.Tensor | None = None  # (N,) for on-policy distillation


@dataclass
class StepInputs:
    traj: torch.Tensor  # (S,) int64 trajectory index, contiguous and ordered
    group_key: torch.Tensor  # (T,) int64 prompt-group key of each trajectory
    reward: torch.Tensor  # (S,) float64 step reward (outcome + process)
    value: torch.Tensor | None = None  # (S,) float64 critic value at each step start
    anchor_key: torch.Tensor | None = None  # (S,) int64 anchor-observation key (GiGPO)
    tokens: TokenInputs | None = None

    @property
    def num_trajectories(self) -> int:
        return int(self.group_key.numel())


@dataclass
class AdvantageConfig:
    gamma: float = 1.0  # discount over steps (or tokens for token-level GAE)
    lam: float = 1.0  # GAE lambda
    norm_by_std: bool = True  # GRPO: divide by the group std (False = Dr.GRPO)
    whiten: bool = True  # GAE / REINFORCE++: whiten over the batch
    eps: float = 1e-6
    gigpo_step_weight: float = 1.0  # GiGPO: A = A_episode + w * A_step
    equal_trajectory_weight: bool = False  # every trajectory weighs the same however many steps it has
    opd_clamp: float = 10.0  # OPD: |log pi_student - log pi_teacher| clamp

    def __post_init__(self) -> None:
        if not 0.0 < self.gamma <= 1.0:
            raise ValueError(f"algorithm.gamma must be in (0, 1], got {self.gamma}")
        if not 0.0 <= self.lam <= 1.0:
            raise ValueError(f"algorithm.lam must be in [0, 1], got {self.lam}")
        if self.eps <= 0 or self.opd_clamp <= 0:
            raise ValueError("algorithm.eps and algorithm.opd_clamp must be > 0")


@dataclass
class Advantages:
    step_adv: torch.Tensor | None = None  # (S,)
    step_ret: torch.Tensor | None = None  # (S,)
    token_adv: torch.Tensor | None = None  # (N,)
    token_ret: torch.Tensor | None = None  # (N,)
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Estimator:
    fn: Callable[[StepInputs, AdvantageConfig, Reducer], Advantages]
    level: str  # "step" or "token"
    needs: tuple[str, ...] = ()  # inputs it requires: value, token_values, teacher_logprobs, anchor


ADVANTAGES: Registry[Estimator] = Registry("advantage estimator")


def register(name: str, level: str = "step", needs: tuple[str, ...] = ()):
    def deco(fn):
        ADVANTAGES.register(name)(Estimator(fn, level, needs))
        return fn

    return deco


def compute_advantages(
    name: str, x: StepInputs, cfg: AdvantageConfig | None = None, reducer: Reducer | None = None
) -> Advantages:
    est = ADVANTAGES.get(name)
    cfg, reducer = cfg or AdvantageConfig(), reducer or LocalReducer()
    missing = {
        "value": x.value is None,
        "token_values": x.tokens is None or x.tokens.values is None,
        "teacher_logprobs": x.tokens is None or x.tokens.teacher_logprobs is None,
        "anchor": x.anchor_key is None,
    }
    for need in est.needs:
        if missing[need]:
            raise ValueError(f"advantage estimator {name!r} needs {need!r}, which the records do not have")
    out = est.fn(x, cfg, reducer)
    if cfg.equal_trajectory_weight and out.step_adv is not None:
        out.step_adv = out.step_adv * _trajectory_weights(x, reducer)
    return out


# ---- helpers ----------------------------------------------------------------------------------
def _not_last(traj: torch.Tensor) -> torch.Tensor:
    return (~segment_ends(traj)).to(torch.float64)


def _flat(mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Groups whose members are all equal (up to rounding of the mean)."""
    return std <= 1e-9 * (1.0 + mean.abs())


def _trajectory_weights(x: StepInputs, reducer: Reducer) -> torch.Tensor:
    """w = (S / T) / |steps of the trajectory|: each trajectory's steps sum to the mean steps."""
    T = x.num_trajectories
    steps = segment_sum(torch.ones_like(x.reward), x.traj, T)
    tot = reducer.allreduce_sum(
        torch.tensor([float(x.traj.numel()), float(T)], dtype=torch.float64, device=x.reward.device)
    )
    return (tot[0] / tot[1]) / steps[x.traj]


def _returns(x: StepInputs) -> torch.Tensor:
    """(T,) undiscounted sum of step rewards per trajectory."""
    return segment_sum(x.reward, x.traj, x.num_trajectories)


def _group_normalized(
    R: torch.Tensor, keys: torch.Tensor, cfg: AdvantageConfig, reducer: Reducer, norm: bool
) -> torch.Tensor:
    mean, std, count = group_stats(keys, R, reducer)
    a = (R - mean) / (std + cfg.eps) if norm else R - mean
    return torch.where((count <= 1) | _flat(mean, std), torch.zeros_like(a), a)


# ---- outcome (trajectory-level) estimators ------------------------------------------------------
@register("grpo")
def grpo(x: StepInputs, cfg: AdvantageConfig, reducer: Reducer) -> Advantages:
    """A_tau = (R_tau - mean_g) / (std_g + eps), broadcast to every step (Dr.GRPO: no std)."""
    R = _returns(x)
    a = _group_normalized(R, x.group_key, cfg, reducer, cfg.norm_by_std)
    return Advantages(a[x.traj], R[x.traj])


@register("dr_grpo")
def dr_grpo(x: StepInputs, cfg: AdvantageConfig, reducer: Reducer) -> Advantages:
    """A_tau = R_tau - mean_g."""
    R = _returns(x)
    a = _group_normalized(R, x.group_key, cfg, reducer, norm=False)
    return Advantages(a[x.traj], R[x.traj])


@register("rloo")
def rloo(x: StepInputs, cfg: AdvantageConfig, reducer: Reducer) -> Advantages:
    """A_tau = R_tau - mean of the other members = n/(n-1) (R_tau - mean_g)."""
    R = _returns(x)
    mean, std, n = group_stats(x.group_key, R, reducer)
    a = torch.where((n <= 1) | _flat(mean, std), torch.zeros_like(R), n / (n - 1).clamp(min=1) * (R - mean))
    return Advantages(a[x.traj], R[x.traj])


@register("reinforce_pp_baseline")
def reinforce_pp_baseline(x: StepInputs, cfg: AdvantageConfig, reducer: Reducer) -> Advantages:
    """A = whiten_batch(R_tau - mean_g), whitening over step records."""
    R = _returns(x)
    a = _group_normalized(R, x.group_key, cfg, reducer, norm=False)[x.traj]
    return Advantages(whiten(a, reducer=reducer), R[x.traj])


@register("reinforce_pp")
def reinforce_pp(x: StepInputs, cfg: AdvantageConfig, reducer: Reducer) -> Advantages:
    """G_t = r_t + gamma G_{t+1} within the trajectory; A = whiten_batch(G)."""
    G = reverse_scan(x.reward, cfg.gamma * _not_last(x.traj))
    return Advantages(whiten(G, reducer=reducer) if cfg.whiten else G, G)


# ---- step-level credit assignment -------------------------------------------------------------
@register("gae", needs=("value",))
def step_gae(x: StepInputs, cfg: AdvantageConfig, reducer: Reducer) -> Advantages:
    """Step-level GAE: delta_t = r_t + gamma V_{t+1} - V_t (V_T = 0), A_t = delta_t + gamma lam A_{t+1},
    R_t = A_t + V_t; A whitened over the batch of steps (StepPO / PSPO)."""
    assert x.value is not None
    nl = _not_last(x.traj)
    v_next = torch.zeros_like(x.value)
    v_next[:-1] = x.value[1:]
    delta = x.reward + cfg.gamma * v_next * nl - x.value
    A = reverse_scan(delta, cfg.gamma * cfg.lam * nl)
    R = A + x.value
    return Advantages(whiten(A, reducer=reducer) if cfg.whiten else A, R)


ADVANTAGES.register("step_gae")(ADVANTAGES.get("gae"))


def _mix64(k: torch.Tensor) -> torch.Tensor:
    """splitmix64-style mixing of int64 keys (wrapping arithmetic)."""
    k = k ^ (k >> 31)
    k = k * 0x7FB5D329728EA185
    k = k ^ (k >> 27)
    k = k * -0x7B1F3A6E5A0D7C4B  # 0x84E0C591A5F283B5 as signed int64
    return k ^ (k >> 33)


@register("gigpo", needs=("anchor",))
def gigpo(x: StepInputs, cfg: AdvantageConfig, reducer: Reducer) -> Advantages:
    """A = A_episode + w A_step. A_episode: GRPO on R_tau. A_step: discounted step returns normalised
    within step groups = steps of the same prompt group with the same anchor observation."""
    if x.anchor_key is None:
        raise ValueError("gigpo needs anchor keys (info.anchor_obs or the observation hash)")
    R = _returns(x)
    a_ep = _group_normalized(R, x.group_key, cfg, reducer, cfg.norm_by_std)[x.traj]
    G = reverse_scan(x.reward, cfg.gamma * _not_last(x.traj))
    step_group = _mix64(x.group_key[x.traj] ^ _mix64(x.anchor_key))
    a_step = _group_normalized(G, step_group, cfg, reducer, cfg.norm_by_std)
    _, _, count = group_stats(step_group, G, reducer)
    metrics = {  # how much the step level has to say (this rank's steps)
        "gigpo/steps_in_step_groups": float((count >= 2).float().mean()) if count.numel() else 0.0,
        "gigpo/step_adv_abs": float(a_step.abs().mean()) if a_step.numel() else 0.0,
    }
    return Advantages(a_ep + cfg.gigpo_step_weight * a_step, G, metrics=metrics)


# ---- token-level --------------------------------------------------------------------------------
@register("token_gae", level="token", needs=("token_values",))
def token_gae(x: StepInputs, cfg: AdvantageConfig, reducer: Reducer) -> Advantages:
    """GAE over the concatenated sampled tokens of all steps of a trajectory. Mask-0 tokens are
    skipped (the recursion bridges them); each step's reward sits on its last sampled token (or, for
    a step with none, on the trajectory's previous sampled token). Masked-whitened over the batch."""
    tk = x.tokens
    assert tk is not None and tk.values is not None
    valid = tk.mask.nonzero().squeeze(1)
    step_of = tk.step[valid]
    traj_of = x.traj[step_of]
    nv = valid.numel()
    # compressed index of the last valid token at or before each step's end
    per_step = segment_sum(tk.mask.to(torch.int64), tk.step, x.traj.numel())
    upto = torch.cumsum(per_step, 0) - 1  # (S,)
    before = torch.cumsum(per_step, 0) - per_step  # valid tokens before each step
    starts = torch.ones_like(x.traj, dtype=torch.bool)
    starts[1:] = x.traj[1:] != x.traj[:-1]
    first_of_traj = before[starts]  # (T,) compressed index of each trajectory's first valid token
    ok = upto >= first_of_traj[x.traj]
    r = x.reward.new_zeros(nv).index_add_(0, upto[ok], x.reward[ok])
    v = tk.values[valid].to(torch.float64)
    nl = (~segment_ends(traj_of)).to(torch.float64)
    v_next = torch.zeros_like(v)
    v_next[:-1] = v[1:]
    delta = r + cfg.gamma * v_next * nl - v
    A = reverse_scan(delta, cfg.gamma * cfg.lam * nl)
    ret = A + v
    A = whiten(A, reducer=reducer) if cfg.whiten else A
    n = tk.step.numel()
    full_a = A.new_zeros(n).index_copy_(0, valid, A)
    full_r = ret.new_zeros(n).index_copy_(0, valid, ret)
    return Advantages(token_adv=full_a, token_ret=full_r)


@register("opd", level="token", needs=("teacher_logprobs",))
def opd(x: StepInputs, cfg: AdvantageConfig, reducer: Reducer) -> Advantages:
    """On-policy distillation: A_t = -clamp(log pi_student(y_t) - log pi_teacher(y_t), +-c) per sampled
    token (the negative sampled-token reverse-KL estimate); 0 on mask-0 tokens."""
    tk = x.tokens
    assert tk is not None and tk.teacher_logprobs is not None and tk.logprobs is not None
    d = (tk.logprobs.to(torch.float64) - tk.teacher_logprobs.to(torch.float64)).clamp(
        -cfg.opd_clamp, cfg.opd_clamp
    )
    a = torch.where(tk.mask, -d, torch.zeros_like(d))
    return Advantages(
        token_adv=a,
        token_ret=a.clone(),
        metrics={"opd/reverse_kl": float(d[tk.mask].mean()) if tk.mask.any() else 0.0},
    )
