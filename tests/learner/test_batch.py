"""``LearnerBatch``: the prefix-merged stream and micro-batches built with vector operations equal
hand-worked layouts and the list-based packing they replace; the columnar update gives the same
losses, gradients and advantages as the frozen list path; the loss is a data-parallel-global mean
over trainable tokens."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))

import list_path  # noqa: E402
from spawn import spawn_ranks  # noqa: E402

from agent_r1.learner.batch import LearnerBatch  # noqa: E402
from agent_r1.records.schema import StepRecord, records_to_table  # noqa: E402
from agent_r1.records.synth import synth_table  # noqa: E402

WORKER = Path(__file__).with_name("batch_worker.py")


def _step(tid, k, obs, act, prefix, mask=None, done=False):
    return StepRecord(
        tid, "g0", k, obs, act, [-0.5] * len(act), mask or [1] * len(act), prefix_len=prefix, done=done,
        reward=1.0 if done else None,
    )  # fmt: skip


def _synth(n=10, seed=3, max_steps=5, vocab=800):
    return synth_table(n, group_size=2, max_steps=max_steps, seed=seed, prompt_len=(5, 12),
                       action_len=(2, 6), feedback_len=(1, 4), vocab=vocab)  # fmt: skip


def test_hand_worked_stream():
    steps = [
        _step("a", 0, [1, 2], [3], 0),
        _step("a", 1, [1, 2, 3, 9], [4, 5], 3),  # appends: continues the sequence
        _step("a", 2, [7, 7], [6], 0),  # rewritten context: a new sequence
        _step("a", 3, [7, 7, 6, 8], [2], 3, mask=[0], done=True),
        _step("b", 0, [5], [5, 5], 0, done=True),
    ]
    b = LearnerBatch.from_table(records_to_table(steps))
    (mb,) = b.micro_batches(None, 100)
    assert mb.tokens.tolist() == [1, 2, 3, 9, 4, 5, 7, 7, 6, 8, 2, 5, 5, 5]
    assert mb.positions.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 0, 1, 2]
    assert mb.cu_seqlens.tolist() == [0, 6, 11, 14] and mb.bounds == [(0, 6), (6, 11), (11, 14)]
    assert mb.label_pos.tolist() == [2, 4, 5, 8, 10, 12, 13]
    assert mb.label_step.tolist() == [0, 1, 1, 2, 3, 4, 4]
    assert mb.label_mask.tolist() == [True, True, True, True, False, True, True]
    assert mb.step_value_pos.tolist() == [1, 3, 7, 9, 11]  # last observation token of each step
    assert b.trainable_per_step.tolist() == [1, 2, 1, 0, 2]
    assert b.num_stream_tokens == 14 and b.num_action_tokens == 7
    # only trajectory "b": indices point back into the batch's flat arrays
    (only_b,) = b.micro_batches(np.array([1]), 100)
    assert only_b.tokens.tolist() == [5, 5, 5] and only_b.act_index.tolist() == [5, 6]
    assert only_b.step_index.tolist() == [4] and only_b.label_pos.tolist() == [1, 2]
    m = mb.attention_mask()[0, 0]
    assert not m[5, 0] and m[6, 5] and m[0, 1]  # causal inside, blocked across sequences


def test_padding_to_a_multiple_is_one_masked_sequence_of_its_own():
    steps = [
        _step("a", 0, [1, 2], [3], 0),
        _step("a", 1, [1, 2, 3, 9], [4, 5], 3),
        _step("b", 0, [5], [5, 5], 0, done=True),
    ]
    b = LearnerBatch.from_table(records_to_table(steps))
    (plain,) = b.micro_batches(None, 100)
    (mb,) = b.micro_batches(None, 100, pad_to=16)
    assert plain.num_tokens == 9 and mb.num_tokens == 16
    assert mb.tokens.tolist() == plain.tokens.tolist() + [0] * 7
    assert mb.positions.tolist() == plain.positions.tolist() + list(range(7))  # its own positions
    assert mb.cu_seqlens.tolist() == [0, 6, 9, 16] and mb.bounds == [(0, 6), (6, 9), (9, 16)]
    assert mb.seq_id.tolist() == [0] * 6 + [1] * 3 + [2] * 7
    for name in ("label_pos", "label_step", "label_mask", "step_value_pos", "act_index", "step_index"):
        assert getattr(mb, name).tolist() == getattr(plain, name).tolist(), name  # no label, no value
    m = mb.attention_mask()[0, 0]
    assert m[9:, :9].all() and m[:9, 9:].all()  # the padding attends to nothing real, nor is attended
    assert b.micro_batches(None, 100, pad_to=3)[0].num_tokens == 9  # a multiple already: no padding
    with pytest.raises(ValueError, match="pad_to must be >= 1"):
        b.micro_batches(None, 100, pad_to=0)


def test_a_padded_update_is_the_unpadded_update(compare):
    """GRPO over micro-batches padded to multiples of 16 (FP8's alignment): the same losses and
    gradients; the padding is trained on by nothing and counted in no denominator."""
    r = compare["padded"]
    for k in ("loss/pg", "entropy", "grad_norm"):
        assert r["padded"][k] == pytest.approx(r["plain"][k], rel=1e-5, abs=1e-7), k
    for name, g in r["grads_plain"].items():
        assert np.allclose(r["grads_padded"][name], g, rtol=1e-4, atol=1e-7), name


def test_empty_observation_is_an_error_naming_the_step():
    with pytest.raises(ValueError, match="'a' step 0: empty observation"):
        LearnerBatch.from_table(records_to_table([_step("a", 0, [], [3], 0, done=True)]))


@pytest.mark.parametrize("shuffle", [False, True])
def test_stream_equals_the_list_packing(shuffle):
    t = _synth()
    if shuffle:  # rows in any order: the batch sorts by trajectory, then step
        t = t.take(pa.array(np.random.default_rng(0).permutation(t.num_rows)))
    b = LearnerBatch.from_table(t)
    trajs = list_path.trajectories_from_table(b.table)
    ref = list_path.pack(trajs)
    (mb,) = b.micro_batches(None, 10**9)
    for name in (
        "tokens",
        "positions",
        "cu_seqlens",
        "label_pos",
        "label_step",
        "label_mask",
        "step_value_pos",
    ):
        assert getattr(mb, name).tolist() == getattr(ref, name).tolist(), name
    assert b.num_stream_tokens < sum(len(o) + len(a) for o, a in zip(
        b.table.column("obs_token_ids").to_pylist(), b.table.column("action_token_ids").to_pylist(), strict=True))  # fmt: skip


def test_micro_batches_cover_every_step_once_within_budget_and_are_reused():
    b = LearnerBatch.from_table(_synth())
    lengths = np.diff(b.traj_tokens)
    budget = int(lengths.max()) + 10
    mbs = b.micro_batches(None, budget)
    assert sorted(i for mb in mbs for i in mb.trajectories.tolist()) == list(range(b.num_trajectories))
    assert all(mb.num_tokens <= budget for mb in mbs)
    assert sorted(torch.cat([mb.act_index for mb in mbs]).tolist()) == list(range(b.num_action_tokens))
    assert sorted(torch.cat([mb.step_index for mb in mbs]).tolist()) == list(range(b.num_steps))
    # the same micro-batches as the list packing (first-fit decreasing over merged lengths)
    ref = list_path.pack_micro_batches(list_path.trajectories_from_table(b.table), budget)
    assert [mb.trajectories.tolist() for mb in mbs] == [r.trajectories.tolist() for r in ref]
    assert b.micro_batches(None, budget) is mbs  # one plan for every pass over the same selection
    assert len(b.micro_batches(None, 1)) == b.num_trajectories  # over budget: one trajectory each
    # a gathered micro-batch equals the stream of its trajectories
    for mb in mbs:
        seg = np.concatenate(
            [b.stream_tokens[b.traj_tokens[i] : b.traj_tokens[i + 1]] for i in mb.trajectories]
        )
        assert mb.tokens.tolist() == seg.tolist()


def test_prefix_merged_logprobs_equal_per_step_recomputation(tiny_model_dir):
    from megatron_rank import per_step_logprobs
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64).eval()
    b = LearnerBatch.from_table(_synth(n=6, seed=0, vocab=model.config.vocab_size))
    (mb,) = b.micro_batches(None, 10**9)
    lps = []
    with torch.no_grad():
        for a, e in mb.bounds:  # one merged sequence per forward (the HF model does not pack)
            logp = torch.log_softmax(model(input_ids=mb.tokens[a:e].unsqueeze(0)).logits[0], -1)
            sel = (mb.label_pos >= a) & (mb.label_pos < e)
            pos = mb.label_pos[sel]
            lps.append(logp[pos - 1 - a].gather(1, mb.tokens[pos, None])[:, 0])
    assert (torch.cat(lps) - per_step_logprobs(model, b.table)).abs().max() < 1e-9


# ---- the update against the frozen list path (spawned: Megatron needs a process group) --------------
@pytest.fixture(scope="module")
def compare(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("batch") / "compare.json"
    spawn_ranks(WORKER, 1, "compare", tiny_model_dir, out)
    return json.loads(out.read_text())


@pytest.mark.parametrize(
    "name", ["grpo", "steppo_minibatches", "ppo_critic_kl", "opd_token_level", "rloo_masked_seq_mean"]
)
def test_update_equals_the_list_path(compare, name):
    r = compare[name]
    new, old = r["new"], r["old"]
    for key in sorted(set(new) & set(old)):  # losses, adv/*, critic/*, grad_norm, mismatch, entropy
        assert new[key] == pytest.approx(old[key], rel=1e-6, abs=1e-6), key
    for key in ("loss/pg", "grad_norm", "mismatch/abs_logprob_diff_rollout_learner"):
        assert key in new and key in old
    assert r["grads_new"].keys() == r["grads_old"].keys()
    scale = max(max(map(abs, g)) for g in r["grads_old"].values())
    assert scale > 1e-3  # the gradients compared are not all zero
    for p, g in r["grads_new"].items():
        assert np.allclose(g, r["grads_old"][p], rtol=0, atol=1e-6), p


def test_mask_zero_tokens_are_not_in_the_denominator(compare):
    m = compare["masked"]
    assert m["trainable"] < m["tokens"]  # the records do have masked tokens
    # the list path divided the same sum by every action token, the batch by the trainable ones
    assert m["new"] == pytest.approx(m["old"] * m["tokens"] / m["trainable"], rel=1e-6)


def test_token_level_gae_trains_its_critic(compare):
    m = compare["token_gae"]
    assert math.isfinite(m["critic/value_loss"]) and m["critic/value_loss"] > 0


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_data_parallel_loss_is_the_global_mean(tiny_model_dir, tmp_path, agg):
    """The same groups on one rank or split over two ranks with different token counts: the same
    gradient (the denominator counts the mini-batch on every rank)."""
    one, two = tmp_path / "dp1.json", tmp_path / "dp2.json"
    spawn_ranks(WORKER, 1, "dp", tiny_model_dir, one, f"algorithm.policy.agg={agg}")
    spawn_ranks(WORKER, 2, "dp", tiny_model_dir, two, f"algorithm.policy.agg={agg}")
    a, b = json.loads(one.read_text()), json.loads(two.read_text())
    assert b["rows"] != a["rows"] - b["rows"]  # rank 0 and rank 1 hold different amounts
    for p, g in a["grads"].items():  # float32 sums in another order: 1e-6 of the largest entry
        g, h = np.asarray(g), np.asarray(b["grads"][p])
        assert np.abs(g - h).max() <= 1e-6 * max(1.0, np.abs(g).max()), p


def test_expert_parallel_micro_batch_counts_are_met_exactly() -> None:
    """Expert parallelism needs as many micro-batches on every rank: ``count`` re-packs the same
    trajectories into exactly that many (each non-empty, every trajectory once, the longest
    spread first); fewer trajectories than micro-batches is an error naming both."""
    from agent_r1.learner.batch import LearnerBatch
    from agent_r1.learner.packing import balanced_bins
    from agent_r1.records.synth import synth_table

    b = LearnerBatch.from_table(synth_table(12, group_size=4, max_steps=3, seed=3, vocab=300))
    natural = b.micro_batches(None, 10**6)
    assert len(natural) == 1
    five = b.micro_batches(None, 10**6, count=5)
    assert len(five) == 5 and all(len(mb.trajectories) >= 1 for mb in five)
    assert sorted(t for mb in five for t in mb.trajectories.tolist()) == list(range(12))
    assert sum(mb.num_tokens for mb in five) == sum(mb.num_tokens for mb in natural)
    assert balanced_bins([5, 1, 4, 2], 2) == [[0, 1], [2, 3]]  # 5 | 4, then 2 joins the 4, 1 the 5: 6 | 6
    with pytest.raises(ValueError, match="12 trajectories cannot fill 13 micro-batches"):
        b.micro_batches(None, 10**6, count=13)
