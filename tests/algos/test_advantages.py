import math
import random

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from threaded import run_ranks

from agent_r1.algos.advantages import (
    ADVANTAGES,
    AdvantageConfig,
    StepInputs,
    TokenInputs,
    compute_advantages,
)
from agent_r1.algos.segments import reverse_scan
from agent_r1.algos.step_rewards import RewardError, RunningReturnStd
from agent_r1.learner.step_inputs import to_step_inputs
from agent_r1.records.synth import synth_table

F64 = torch.float64


def build(trajs):
    """trajs: list of dicts(group, r, v, anchor) -> StepInputs (trajectory order as given)."""
    traj = torch.tensor([i for i, t in enumerate(trajs) for _ in t["r"]], dtype=torch.int64)
    return StepInputs(
        traj=traj,
        group_key=torch.tensor([t["group"] for t in trajs], dtype=torch.int64),
        reward=torch.tensor([x for t in trajs for x in t["r"]], dtype=F64),
        value=torch.tensor([x for t in trajs for x in t["v"]], dtype=F64),
        anchor_key=torch.tensor([x for t in trajs for x in t["anchor"]], dtype=torch.int64),
    )


def random_trajs(rng, n=40, groups=8, max_steps=6, flat_groups=True):
    out = []
    for _ in range(n):
        g = rng.randrange(groups)
        if flat_groups and g % 4 == 0:  # zero-variance groups: every member identical
            out.append({"group": g, "r": [0.5], "v": [0.3], "anchor": [1]})
            continue
        k = rng.randint(1, max_steps)
        out.append(
            {
                "group": g,
                "r": [rng.choice([0.0, 0.0, 0.2, -0.1]) for _ in range(k - 1)] + [float(rng.random() < 0.5)],
                "v": [rng.random() for _ in range(k)],
                "anchor": [rng.randrange(3) for _ in range(k)],
            }
        )
    return out


# ---- hand-worked examples -----------------------------------------------------------------------
HAND = [
    {"group": 5, "r": [0.0, 1.0], "v": [0.5, 0.5], "anchor": [0, 1]},
    {"group": 5, "r": [0.0], "v": [0.1], "anchor": [0]},
    {"group": 9, "r": [0.0, 0.0, 2.0], "v": [0.2, 0.3, 0.4], "anchor": [0, 1, 2]},
]


def test_hand_grpo_family():
    x = build(HAND)
    # group 5: R = 1, 0 -> mean 0.5, std (n-1) = sqrt(0.5); group 9 has one member -> 0
    s = 1 / math.sqrt(2)
    assert compute_advantages("grpo", x).step_adv.tolist() == pytest.approx(
        [0.5 / (s + 1e-6)] * 2 + [-0.5 / (s + 1e-6)] + [0] * 3
    )
    assert compute_advantages("dr_grpo", x).step_adv.tolist() == pytest.approx([0.5, 0.5, -0.5, 0, 0, 0])
    assert compute_advantages("rloo", x).step_adv.tolist() == pytest.approx([1, 1, -1, 0, 0, 0])
    assert compute_advantages("grpo", x).step_ret.tolist() == [1, 1, 0, 2, 2, 2]


def test_hand_step_gae():
    # gamma = lam = 1: A = [0.5, 0.5 | -0.1 | 1.8, 1.7, 1.6]; whitened: mean 1.0, std 0.8
    x = build(HAND)
    raw = compute_advantages("gae", x, AdvantageConfig(whiten=False))
    assert raw.step_adv.tolist() == pytest.approx([0.5, 0.5, -0.1, 1.8, 1.7, 1.6])
    assert raw.step_ret.tolist() == pytest.approx([1.0, 1.0, 0.0, 2.0, 2.0, 2.0])
    w = compute_advantages("gae", x).step_adv
    assert w.tolist() == pytest.approx([(a - 1.0) / 0.8 for a in [0.5, 0.5, -0.1, 1.8, 1.7, 1.6]], abs=1e-6)
    # gamma 0.5, lam 0.5 on trajectory 3: delta = [0.5*0.3-0.2, 0.5*0.4-0.3, 2-0.4] = [-0.05, -0.1, 1.6]
    # A2 = 1.6, A1 = -0.1 + 0.25*1.6 = 0.3, A0 = -0.05 + 0.25*0.3 = 0.025
    g = compute_advantages("gae", build(HAND[2:]), AdvantageConfig(gamma=0.5, lam=0.5, whiten=False))
    assert g.step_adv.tolist() == pytest.approx([0.025, 0.3, 1.6])


def test_hand_reinforce_pp_and_gigpo():
    x = build(HAND)
    G = compute_advantages("reinforce_pp", x, AdvantageConfig(gamma=0.5, whiten=False)).step_adv
    assert G.tolist() == pytest.approx([0.5, 1.0, 0.0, 0.5, 1.0, 2.0])
    # GiGPO: anchors (group 5, anchor 0) hold step 0 of traj 0 (G=1) and traj 1 (G=0): A_step = +-1/sqrt(2)
    gi = compute_advantages("gigpo", x, AdvantageConfig(gamma=1.0, gigpo_step_weight=0.5))
    ep = compute_advantages("grpo", x).step_adv
    s = 1 / math.sqrt(2)
    step = [0.5 / (s + 1e-6), 0.0, -0.5 / (s + 1e-6), 0.0, 0.0, 0.0]
    assert gi.step_adv.tolist() == pytest.approx(
        [e + 0.5 * a for e, a in zip(ep.tolist(), step, strict=True)]
    )
    # logged: 2 of the 6 steps are in a step group of size >= 2; the mean |A_step|
    assert gi.metrics["gigpo/steps_in_step_groups"] == pytest.approx(2 / 6)
    assert gi.metrics["gigpo/step_adv_abs"] == pytest.approx(sum(abs(a) for a in step) / 6)


# ---- float64 loop references --------------------------------------------------------------------
def ref_all(trajs, name, gamma=1.0, lam=1.0, eps=1e-6, norm=True):
    R = [sum(t["r"]) for t in trajs]
    df = pd.DataFrame({"g": [t["group"] for t in trajs], "R": R})
    mean = df.groupby("g").R.transform("mean").to_numpy()
    std = df.groupby("g").R.transform(lambda s: s.std(ddof=1) if len(s) > 1 else 0.0).to_numpy()
    cnt = df.groupby("g").R.transform("count").to_numpy()
    flat = (cnt <= 1) | (std <= 1e-9 * (1 + np.abs(mean)))
    out = []
    if name in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"):
        for i, t in enumerate(trajs):
            if flat[i]:
                a = 0.0
            elif name == "grpo":
                a = (R[i] - mean[i]) / (std[i] + eps) if norm else R[i] - mean[i]
            elif name == "rloo":
                a = cnt[i] / (cnt[i] - 1) * (R[i] - mean[i])
            else:
                a = R[i] - mean[i]
            out += [a] * len(t["r"])
        if name == "reinforce_pp_baseline":
            arr = np.array(out)
            out = list((arr - arr.mean()) / np.sqrt(arr.var(ddof=1) + 1e-8))
        return np.array(out)
    if name == "gae":
        for t in trajs:
            adv, last = [0.0] * len(t["r"]), 0.0
            for k in reversed(range(len(t["r"]))):
                nv = t["v"][k + 1] if k + 1 < len(t["r"]) else 0.0
                delta = t["r"][k] + gamma * nv - t["v"][k]
                last = delta + gamma * lam * last
                adv[k] = last
            out += adv
        arr = np.array(out)
        return (arr - arr.mean()) / np.sqrt(arr.var(ddof=1) + 1e-8)
    if name == "reinforce_pp":
        for t in trajs:
            g, ret = 0.0, [0.0] * len(t["r"])
            for k in reversed(range(len(t["r"]))):
                g = t["r"][k] + gamma * g
                ret[k] = g
            out += ret
        arr = np.array(out)
        return (arr - arr.mean()) / np.sqrt(arr.var(ddof=1) + 1e-8)
    raise KeyError(name)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "gae", "reinforce_pp"])
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.7)])
def test_against_float64_loop_reference(name, gamma, lam):
    trajs = random_trajs(random.Random(hash((name, gamma)) % 1000), n=60)
    got = compute_advantages(name, build(trajs), AdvantageConfig(gamma=gamma, lam=lam)).step_adv.numpy()
    ref = ref_all(trajs, "grpo" if name == "dr_grpo" else name, gamma, lam, norm=name != "dr_grpo")
    np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-9)


def test_reverse_scan_matches_loop():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 300, 50)
    x = rng.normal(size=lengths.sum())
    seg = np.repeat(np.arange(50), lengths)
    decay = np.where(np.r_[seg[1:] != seg[:-1], True], 0.0, 0.97)
    y = reverse_scan(torch.from_numpy(x), torch.from_numpy(decay)).numpy()
    ref = np.zeros_like(x)
    for i in reversed(range(len(x))):
        ref[i] = x[i] + decay[i] * (ref[i + 1] if i + 1 < len(x) else 0.0)
    np.testing.assert_allclose(y, ref, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="last element"):
        reverse_scan(torch.ones(3, dtype=F64), torch.ones(3, dtype=F64))


def test_token_gae_against_loop():
    rng = random.Random(5)
    steps_tokens, traj = [], []
    for t in range(6):
        for _ in range(rng.randint(1, 3)):
            traj.append(t)
            steps_tokens.append(rng.randint(0, 5))  # a step may have no tokens
    S, N = len(traj), sum(steps_tokens)
    step = torch.tensor([s for s, n in enumerate(steps_tokens) for _ in range(n)], dtype=torch.int64)
    mask = torch.tensor([rng.random() > 0.25 for _ in range(N)])
    values = torch.rand(N, dtype=F64)
    reward = torch.tensor([rng.choice([0.0, 1.0, -0.5]) for _ in range(S)], dtype=F64)
    x = StepInputs(
        traj=torch.tensor(traj),
        group_key=torch.arange(6),
        reward=reward,
        tokens=TokenInputs(step, mask, values=values),
    )
    gamma, lam = 0.95, 0.9
    out = compute_advantages("token_gae", x, AdvantageConfig(gamma=gamma, lam=lam, whiten=False))
    # loop reference: per trajectory, valid tokens in order; each step's reward on its last valid
    # token, or on the previous valid token of the trajectory when the step has none
    ref_adv = np.zeros(N)
    for t in range(6):
        toks = [i for i in range(N) if traj[int(step[i])] == t and mask[i]]
        r = {i: 0.0 for i in toks}
        for s in [s for s in range(S) if traj[s] == t]:
            upto = [i for i in toks if int(step[i]) <= s]
            if upto:
                r[upto[-1]] += float(reward[s])
        last = 0.0
        for j in reversed(range(len(toks))):
            i = toks[j]
            nv = float(values[toks[j + 1]]) if j + 1 < len(toks) else 0.0
            last = r[i] + gamma * nv - float(values[i]) + gamma * lam * last
            ref_adv[i] = last
    np.testing.assert_allclose(out.token_adv.numpy(), ref_adv, atol=1e-12)
    assert (out.token_adv[~mask] == 0).all()


def test_opd_advantages():
    lp = torch.tensor([-1.0, -2.0, -30.0, -0.5], dtype=F64)
    teacher = torch.tensor([-0.5, -2.5, -0.1, -9.0], dtype=F64)
    mask = torch.tensor([True, True, True, False])
    x = StepInputs(
        torch.tensor([0]),
        torch.tensor([0]),
        torch.zeros(1, dtype=F64),
        tokens=TokenInputs(torch.zeros(4, dtype=torch.int64), mask, lp, teacher_logprobs=teacher),
    )
    a = compute_advantages("opd", x, AdvantageConfig(opd_clamp=10)).token_adv
    assert a.tolist() == [0.5, -0.5, 10.0, 0.0]


def test_equal_trajectory_weight():
    x = build(HAND)
    a = compute_advantages("dr_grpo", x, AdvantageConfig(equal_trajectory_weight=True)).step_adv
    # S/T = 2; traj 0 (2 steps) x1, traj 1 (1 step) x2
    assert a.tolist() == pytest.approx([0.5, 0.5, -1.0, 0, 0, 0])


def test_missing_inputs_named():
    x = build(HAND)
    x.value = None
    with pytest.raises(ValueError, match="'gae' needs 'value'"):
        compute_advantages("gae", x)
    with pytest.raises(ValueError, match="'token_gae' needs 'token_values'"):
        compute_advantages("token_gae", x)
    with pytest.raises(KeyError, match="unknown advantage estimator 'ppo'"):
        compute_advantages("ppo", x)
    with pytest.raises(ValueError, match="gamma"):
        AdvantageConfig(gamma=0)


# ---- NaN safety and sharding invariance -------------------------------------------------------------
STEP_ESTIMATORS = ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "reinforce_pp", "gae", "gigpo"]


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10**6), st.integers(1, 3), st.sampled_from(STEP_ESTIMATORS), st.booleans())
def test_property_sharding_and_order_invariance(seed, world, name, equal_w):
    rng = random.Random(seed)
    trajs = random_trajs(rng, n=rng.randint(1, 30), groups=rng.randint(1, 6))
    cfg = AdvantageConfig(
        gamma=rng.choice([1.0, 0.9]), lam=rng.choice([1.0, 0.8]), equal_trajectory_weight=equal_w
    )
    whole = compute_advantages(name, build(trajs), cfg).step_adv.numpy()
    assert np.isfinite(whole).all()
    offsets = np.r_[0, np.cumsum([len(t["r"]) for t in trajs])]
    owner = [rng.randrange(world) for _ in trajs]
    parts = []
    for r in range(world):
        idx = [i for i in range(len(trajs)) if owner[i] == r]
        rng.shuffle(idx)
        parts.append(idx)

    def rank_fn(r, reducer):
        idx = parts[r]
        sub = [trajs[i] for i in idx]
        if not sub:
            x = StepInputs(
                torch.zeros(0, dtype=torch.int64),
                torch.zeros(0, dtype=torch.int64),
                torch.zeros(0, dtype=F64),
                torch.zeros(0, dtype=F64),
                torch.zeros(0, dtype=torch.int64),
            )
        else:
            x = build(sub)
        return compute_advantages(name, x, cfg, reducer).step_adv.numpy()

    results = run_ranks(world, rank_fn)
    got = np.zeros_like(whole)
    for r in range(world):
        pos = 0
        for i in parts[r]:
            n = len(trajs[i]["r"])
            got[offsets[i] : offsets[i] + n] = results[r][pos : pos + n]
            pos += n
    np.testing.assert_allclose(got, whole, rtol=1e-9, atol=1e-9)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.sampled_from([0.0, 1.0, 0.3, 1e-12, 5.0])), min_size=1, max_size=12
    ),
    st.sampled_from(STEP_ESTIMATORS),
)
def test_property_no_nan_and_flat_groups_zero(members, name):
    trajs = [{"group": g, "r": [r], "v": [0.5], "anchor": [0]} for g, r in members]
    a = compute_advantages(name, build(trajs)).step_adv
    assert torch.isfinite(a).all()
    if name in ("grpo", "dr_grpo", "rloo"):
        for i, (g, _r) in enumerate(members):
            same = [rr for gg, rr in members if gg == g]
            if len(same) == 1 or len(set(same)) == 1:
                assert a[i] == 0.0


# ---- rewards through the records layer ---------------------------------------------------------------
def test_records_to_inputs_and_reward_errors():
    t = synth_table(12, group_size=3, max_steps=4, seed=9)
    b = to_step_inputs(t.take(np.random.default_rng(0).permutation(t.num_rows)))
    assert b.inputs.num_trajectories == 12
    # steps come back contiguous per trajectory and in step order
    tids = b.table.column("trajectory_id").to_pylist()
    steps = b.table.column("step_index").to_pylist()
    seen = [t for i, t in enumerate(tids) if i == 0 or tids[i - 1] != t]
    assert len(seen) == len(set(seen)) == 12
    assert all(steps[i] == steps[i - 1] + 1 for i in range(1, len(tids)) if tids[i] == tids[i - 1])
    assert to_step_inputs(t).identity  # synth writes trajectories in order: no reordering
    reward = t.column("reward").to_pylist()
    i = t.column("done").to_pylist().index(True)
    bad = list(reward)
    bad[i] = float("nan")
    import pyarrow as pa

    t_nan = t.set_column(t.schema.get_field_index("reward"), "reward", pa.array(bad, pa.float64()))
    with pytest.raises(
        RewardError, match=rf"trajectory '{t.column('trajectory_id')[i].as_py()}'.*non-finite"
    ):
        to_step_inputs(t_nan)
    bad[i] = None
    with pytest.raises(RewardError, match="terminal step has no reward"):
        to_step_inputs(
            t.set_column(t.schema.get_field_index("reward"), "reward", pa.array(bad, pa.float64()))
        )
    # process rewards are added with their coefficient; nulls count 0
    b0, b2 = to_step_inputs(t, process_coef=0.0), to_step_inputs(t, process_coef=2.0)
    proc = [sum(x for x in p if x is not None) for p in b0.table.column("process_reward").to_pylist()]
    np.testing.assert_allclose((b2.inputs.reward - b0.inputs.reward).numpy(), 2 * np.array(proc))


def test_running_return_std_matches_numpy_and_merges_ranks():
    rng = np.random.default_rng(1)
    batches = []
    for _ in range(3):
        lengths = rng.integers(1, 5, 10)
        traj = torch.from_numpy(np.repeat(np.arange(10), lengths))
        r = torch.from_numpy(rng.normal(size=lengths.sum()))
        batches.append((r, traj))
    rs = RunningReturnStd(gamma=0.9)
    all_g = []
    for r, traj in batches:
        scaled = rs.scale(r, traj)
        g = rs.forward_returns(r, traj).numpy()
        all_g.append(g)
        ref_std = np.concatenate(all_g).std()
        np.testing.assert_allclose(scaled.numpy(), r.numpy() / np.sqrt(ref_std**2 + 1e-8), rtol=1e-10)
    # forward return by hand: G_t = 0.9 G_{t-1} + r_t
    r = torch.tensor([1.0, 2.0, 3.0], dtype=F64)
    assert rs.forward_returns(r, torch.tensor([0, 0, 1])).tolist() == pytest.approx([1.0, 2.9, 3.0])
    # two ranks holding halves = one process holding all
    r, traj = batches[0]
    whole = RunningReturnStd(gamma=0.9)
    ref = whole.scale(r, traj).numpy()
    cut = int((traj < 5).sum())

    def fn(rank, red):
        sl = slice(0, cut) if rank == 0 else slice(cut, None)
        return RunningReturnStd(gamma=0.9).scale(r[sl], traj[sl], red).numpy()

    got = np.concatenate(run_ranks(2, fn))
    np.testing.assert_allclose(got, ref, rtol=1e-10)
    st2 = RunningReturnStd(gamma=0.9)
    st2.load_state_dict(whole.state_dict())
    assert st2.state_dict() == whole.state_dict()


def test_registry_is_complete():
    assert set(ADVANTAGES.names()) >= {
        "grpo",
        "dr_grpo",
        "rloo",
        "reinforce_pp",
        "reinforce_pp_baseline",
        "gae",
        "step_gae",
        "token_gae",
        "gigpo",
        "opd",
    }
