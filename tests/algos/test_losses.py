import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agent_r1.algos.losses import (
    AGG_MODES,
    POLICY_LOSSES,
    LossConfig,
    LossInputs,
    aggregate,
    behaviour_weight,
    kl_penalty,
    loss_config,
    policy_loss,
)

F64 = torch.float64


def inputs(lp, old, adv, mask, seg, **kw):
    lp = torch.tensor(lp, dtype=F64, requires_grad=True)
    return LossInputs(
        lp,
        torch.tensor(old, dtype=F64),
        torch.tensor(adv, dtype=F64),
        torch.tensor(mask, dtype=torch.bool),
        torch.tensor(seg, dtype=torch.int64),
        max(seg) + 1 if seg else 0,
        **{k: torch.tensor(v, dtype=F64) for k, v in kw.items()},
    )


def test_hand_ppo_and_dual_clip():
    # ratio e^-0.1 = 0.9048 inside [0.8, 1.2]; token-mean over the 5 valid tokens
    x = inputs(
        [-1, -2, -0.5, -1, -3, -0.1],
        [-0.9, -1.9, -0.4, -0.9, -2.9, 0.0],
        [1, 1, 1, -1, -1, -1],
        [1, 1, 0, 1, 1, 1],
        [0, 0, 0, 1, 1, 2],
    )
    loss, m = policy_loss("ppo", x)
    r = math.exp(-0.1)
    assert float(loss.detach()) == pytest.approx((-2 * r + 3 * r) / 5)
    loss.backward()
    assert x.logprobs.grad.tolist() == pytest.approx([-r / 5, -r / 5, 0, r / 5, r / 5, r / 5])
    assert m["clipfrac"] == 0.0
    # ratio e^2 = 7.39: A>0 clipped at 1.2 (no grad); A<0 -> dual clip at -A*c = 3
    y = inputs([0.0, 0.0], [-2.0, -2.0], [1.0, -1.0], [1, 1], [0, 1])
    loss, m = policy_loss("ppo", y)
    assert float(loss.detach()) == pytest.approx((-1.2 + 3.0) / 2)
    loss.backward()
    assert y.logprobs.grad.tolist() == [0.0, 0.0]
    assert m["clipfrac"] == 0.5 and m["dual_clipfrac"] == 0.5


def test_hand_gspo_steppo_pspo():
    # segment 0: log ratios -0.2, 0.0 -> s = e^-0.1; segment 1: log ratio +0.3 -> s = e^0.3 (A=-1)
    x = inputs([-1.2, -1.0, -0.7], [-1.0, -1.0, -1.0], [2.0, 2.0, -1.0], [1, 1, 1], [0, 0, 1])
    s0, s1 = math.exp(-0.1), math.exp(0.3)
    loss, m = policy_loss("gspo", x, LossConfig(agg="token-mean"))
    # token-mean of per-token objectives: seg 0 unclipped -2 s0 (x2), seg 1: max(s1, clip 1.2) = s1 (A=-1)
    assert float(loss.detach()) == pytest.approx((-2 * s0 * 2 + s1) / 3)
    loss.backward()
    assert x.logprobs.grad.tolist() == pytest.approx([-2 * s0 / 3, -2 * s0 / 3, s1 / 3])
    assert m["ratio/max"] == pytest.approx(s1)
    x.logprobs.grad = None
    loss, _ = policy_loss("steppo", x)  # seq-mean-token-mean: (mean(-2 s0, -2 s0) + s1) / 2
    assert float(loss.detach()) == pytest.approx((-2 * s0 + s1) / 2)
    loss, m = policy_loss("pspo", x)  # clip [1-3e-4, 1+4e-4]: seg 0 unclipped side is min; seg 1 clipped
    assert float(loss.detach()) == pytest.approx((-2 * s0 + s1) / 2)
    assert loss_config("pspo").clip_low == 3e-4 and loss_config("pspo", clip_low=0.1).clip_low == 0.1


def test_reinforce_and_opd():
    x = inputs([-1.0, -2.0], [-1.0, -2.0], [0.5, -1.0], [1, 1], [0, 0])
    loss, _ = policy_loss("reinforce", x)
    assert float(loss.detach()) == pytest.approx((0.5 * 1.0 + -1.0 * 2.0) / 2)
    # OPD's advantages come from the `opd` estimator (one place, one clamp); its loss is the PPO clip
    y = inputs([-1.0, -2.0], [-1.1, -2.0], [0.5, -10.0], [1, 1], [0, 0], teacher_logprobs=[-0.5, -30.0])
    assert float(policy_loss("opd", y)[0]) == pytest.approx(float(policy_loss("ppo", y)[0]))


def test_kl_estimators_and_entropy():
    lp, ref = torch.tensor([-1.0, -2.0], dtype=F64), torch.tensor([-1.5, -1.0], dtype=F64)
    d = lp - ref
    assert kl_penalty(lp, ref, "k1").tolist() == pytest.approx(d.tolist())
    assert kl_penalty(lp, ref, "k2").tolist() == pytest.approx((0.5 * d**2).tolist())
    k3 = kl_penalty(lp, ref, "k3")
    assert k3.tolist() == pytest.approx((torch.exp(-d) - 1 + d).tolist()) and (k3 >= 0).all()
    x = inputs(
        [-1.0, -2.0], [-1.0, -2.0], [0.0, 0.0], [1, 1], [0, 0], ref_logprobs=[-1.5, -1.0], entropy=[0.3, 0.5]
    )
    loss, m = policy_loss("ppo", x, LossConfig(kl_coef=0.1, entropy_coef=0.01))
    assert float(loss.detach()) == pytest.approx(0.1 * float(k3.mean()) - 0.01 * 0.4)
    assert m["loss/kl"] == pytest.approx(float(k3.mean())) and m["entropy"] == pytest.approx(0.4)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss("ppo", inputs([-1.0], [-1.0], [1.0], [1], [0]), LossConfig(kl_coef=0.1))


def test_tis_and_mismatch():
    x = inputs([-1.0, -1.0], [-1.0, -1.0], [1.0, 1.0], [1, 1], [0, 1], rollout_logprobs=[-3.0, -1.5])
    loss, m = policy_loss("ppo", x, LossConfig(tis_cap=2.0))
    # weights exp(old - rollout) = e^2 -> capped 2, e^0.5 = 1.6487
    assert m["tis/weight_mean"] == pytest.approx((2.0 + math.exp(0.5)) / 2)
    assert m["mismatch/abs_logprob_diff"] == pytest.approx(1.25)
    assert float(loss.detach()) == pytest.approx(-(2.0 + math.exp(0.5)) / 2)


def test_tis_counts_what_the_cap_truncated_and_zero_turns_it_off():
    x = inputs([-1.0, -1.0], [-1.0, -1.0], [1.0, 1.0], [1, 1], [0, 1], rollout_logprobs=[-3.0, -1.5])
    _, m = policy_loss("ppo", x, LossConfig(tis_cap=2.0))
    assert m["tis/truncated_fraction"] == pytest.approx(0.5)  # e^2 > 2: one token of two
    loss, m = policy_loss("ppo", x, LossConfig(tis_cap=0))  # off: the plain clipped objective
    assert "tis/weight_mean" not in m and float(loss.detach()) == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="tis_cap"):
        LossConfig(tis_cap=-1.0)


@pytest.mark.parametrize("name", ["steppo", "pspo", "gspo"])
def test_step_losses_weigh_each_step_by_its_length_normalised_behaviour_ratio(name):
    """StepPO / PSPO / GSPO: one behaviour weight per step, exp(mean over the step's sampled tokens of
    log pi_prox - log mu), capped, on each of its tokens (a masked token counts for nothing)."""
    old = [-1.0, -2.0, -1.0, -1.0, -0.5]
    roll = [-1.5, -2.5, -9.0, -1.0, -0.1]  # step 0: +0.5 on each sampled token; step 1: 0 and -0.4
    x = inputs(old, old, [1.0] * 5, [1, 1, 0, 1, 1], [0, 0, 0, 1, 1], rollout_logprobs=roll)
    w, m = behaviour_weight(x, 5.0, POLICY_LOSSES.get(name).ratio_level)
    want = [math.exp(0.5)] * 3 + [math.exp(-0.2)] * 2
    assert torch.allclose(w, torch.tensor(want, dtype=F64))
    assert m["tis/weight_mean"] == pytest.approx((2 * math.exp(0.5) + 2 * math.exp(-0.2)) / 4)
    w, m = behaviour_weight(x, 1.5, "segment")  # e^0.5 = 1.65 > 1.5: step 0's two tokens truncated
    assert m["tis/truncated_fraction"] == pytest.approx(0.5) and float(w[0]) == 1.5
    # per token (PPO / GRPO): each token its own ratio
    w, _ = behaviour_weight(x, 5.0, POLICY_LOSSES.get("grpo").ratio_level)
    assert torch.allclose(
        w[[0, 1, 3, 4]], torch.tensor([math.exp(0.5), math.exp(0.5), 1.0, math.exp(-0.4)], dtype=F64)
    )


def test_empty_mask_zero_loss_zero_grad_even_with_nan_outside():
    for name in ("ppo", "gspo", "steppo", "reinforce"):
        x = inputs([float("nan"), -1e30], [0.0, float("inf")], [float("nan"), 1.0], [0, 0], [0, 1])
        for agg in AGG_MODES:
            loss, _ = policy_loss(name, x, LossConfig(agg=agg))
            loss.backward()
            assert float(loss.detach()) == 0.0 and x.logprobs.grad is not None
            assert torch.equal(x.logprobs.grad, torch.zeros(2, dtype=F64)), (name, agg)
            x.logprobs.grad = None


def ref_loss(name, lp, old, adv, mask, seg, agg, lo=0.2, hi=0.2, c=3.0):
    """Plain-Python per-token loop (float64)."""
    n = len(lp)
    per = [0.0] * n
    segs = sorted(set(seg))
    seq_lr = {}
    for s in segs:
        idx = [i for i in range(n) if seg[i] == s and mask[i]]
        seq_lr[s] = sum(lp[i] - old[i] for i in idx) / max(len(idx), 1)
    for i in range(n):
        if not mask[i]:
            continue
        ratio = math.exp(seq_lr[seg[i]]) if name == "gspo" else math.exp(lp[i] - old[i])
        a = adv[i]
        pg = max(-a * ratio, -a * min(max(ratio, 1 - lo), 1 + hi))
        if name == "ppo" and a < 0:
            pg = min(pg, -a * c)
        per[i] = pg
    valid = [i for i in range(n) if mask[i]]
    if agg == "token-mean":
        return sum(per[i] for i in valid) / max(len(valid), 1)
    tot, k = 0.0, 0
    for s in segs:
        idx = [i for i in valid if seg[i] == s]
        if idx:
            v = sum(per[i] for i in idx)
            tot += v / len(idx) if agg == "seq-mean-token-mean" else v
            k += 1
    return tot / max(k, 1)


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 10**6), st.sampled_from(["ppo", "gspo"]), st.sampled_from(AGG_MODES))
def test_property_against_loop_reference(seed, name, agg):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 30))
    seg = sorted(rng.integers(0, 6, n).tolist())
    lp = rng.normal(-1, 0.5, n).tolist()
    old = (np.array(lp) + rng.normal(0, 0.3, n)).tolist()
    adv = rng.normal(0, 1, n).tolist()
    mask = (rng.random(n) > 0.2).tolist()
    x = inputs(lp, old, adv, mask, seg)
    got, _ = policy_loss(name, x, LossConfig(clip_low=0.2, clip_high=0.2, clip_c=3.0, agg=agg))
    assert float(got) == pytest.approx(ref_loss(name, lp, old, adv, mask, seg, agg), rel=1e-10, abs=1e-12)


@pytest.mark.parametrize("name", ["ppo", "gspo", "steppo", "reinforce"])
@pytest.mark.parametrize("agg", AGG_MODES)
def test_gradcheck(name, agg):
    """Analytic gradient = finite differences. GSPO's stop-gradient form equals the true gradient of
    its sequence objective only under seq-mean-token-mean (with token-mean it is GSPO-token's
    gradient, checked by hand in test_hand_gspo_steppo_pspo)."""
    if name == "gspo" and agg != "seq-mean-token-mean":
        pytest.skip("GSPO-token gradient is not the derivative of the loss value by design")
    torch.manual_seed(0)
    n = 9
    old = torch.randn(n, dtype=F64) * 0.1 - 1
    lp0 = old + torch.randn(n, dtype=F64) * 0.01  # ratios near 1: away from the clip kinks
    mask = torch.tensor([1, 1, 0, 1, 1, 1, 0, 1, 1], dtype=torch.bool)
    seg = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 3])
    adv = torch.randn(4, dtype=F64)[seg]  # one advantage per step, as the estimators produce

    def f(lp):
        return policy_loss(name, LossInputs(lp, old, adv, mask, seg, 4), LossConfig(agg=agg))[0]

    assert torch.autograd.gradcheck(f, (lp0.clone().requires_grad_(True),))


def test_aggregate_modes_and_global_denominator():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=F64)
    mask = torch.tensor([True, True, True, False])
    seg = torch.tensor([0, 0, 1, 2])
    assert float(aggregate(x, mask, seg, 3, "token-mean")) == pytest.approx(2.0)
    assert float(aggregate(x, mask, seg, 3, "seq-mean-token-mean")) == pytest.approx((1.5 + 3.0) / 2)
    assert float(aggregate(x, mask, seg, 3, "seq-mean-token-sum")) == pytest.approx((3.0 + 3.0) / 2)
    assert float(aggregate(x, mask, seg, 3, "token-mean", denom=6.0)) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="agg"):
        LossConfig(agg="mean")
    with pytest.raises(ValueError, match="clip_c"):
        LossConfig(clip_c=0.5)
