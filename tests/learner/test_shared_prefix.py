"""Shared prefixes in the learner (``optim.share_prefix``): a group's trajectories share their
prompt's rows instead of repeating them, and the logprobs, the gradient and the update are those of
the plain packing; the attention of a branch equals masked attention with the mask written out."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from spawn import spawn_ranks

WORKER = Path(__file__).with_name("megatron_shared_prefix_worker.py")


@pytest.fixture(scope="module")
def results(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("shared") / "results.json"
    spawn_ranks(WORKER, 1, tiny_model_dir, out, timeout=600)
    return json.loads(out.read_text())


def test_shared_prefixes_pack_fewer_tokens(results):
    assert results["branches"] >= 9  # 3 groups of 4: at least 3 followers each
    # each follower leaves out at least its group's prompt (35..43 tokens) of the plain stream
    assert results["plain_tokens"] == results["stream_tokens"]
    assert results["shared_tokens"] <= results["plain_tokens"] - 9 * 35


def test_logprobs_gradient_and_update_are_the_plain_packings(results):
    assert results["logprob_max_diff"] < 1e-5 * max(1.0, results["logprob_scale"])
    plain, shared = results["grad_norms"]
    assert plain > 0 and shared == pytest.approx(plain, rel=1e-4)
    assert results["weight_max_change"] > 1e-4  # the step moved the weights ...
    # ... the same way. Adam's first step is about lr * g / (|g| + eps) per weight, so a weight whose
    # gradient is near zero moves by whatever its last bits say (float32 sums in another order: up
    # to 1 % of lr on one CPU, 0.3 % on another); the update as a whole vector agrees far closer
    assert results["weight_max_diff"] < 0.1 * results["weight_max_change"]
    assert results["update_rel_diff"] < 1e-3


def test_branch_attention_equals_the_written_out_mask():
    """``PackedAttention``'s buckets against SDPA over the whole stream with ``Packed``'s own mask
    (built independently from the parents), outputs and the gradients of q, k and v."""
    from agent_r1.learner.attention import AttentionPlan, PackedAttention
    from agent_r1.learner.packing import Packed

    torch.manual_seed(0)
    # stream: root A (10 rows), branch B of A's first 6 rows (4 rows), root C (5), branch D of C's 5 (3)
    bounds = [(0, 10), (10, 14), (14, 19), (19, 22)]
    parents = [(0, 0), (0, 6), (0, 0), (14, 5)]
    n, heads, hn = 22, 2, 8
    seq_id = torch.repeat_interleave(torch.arange(4), torch.tensor([10, 4, 5, 3]))
    zeros = torch.zeros(n, dtype=torch.long)
    mb = Packed(zeros, zeros, seq_id, torch.tensor([0, 10, 14, 19, 22]), zeros[:0], zeros[:0], zeros[:0].bool(),
                0, zeros[:0], zeros[:0], zeros[:0], bounds, None, parents=parents)  # fmt: skip
    q, k, v = (torch.randn(n, 1, heads, hn, dtype=torch.float64, requires_grad=True) for _ in range(3))

    class Inner(torch.nn.Module):
        softmax_scale = hn**-0.5

    attn = PackedAttention(Inner(), {"plan": AttentionPlan.of(bounds, torch.device("cpu"), parents=parents)})
    got = attn(q, k, v, None)
    allowed = ~mb.attention_mask()[0, 0]
    qt, kt, vt = (x.squeeze(1).transpose(0, 1) for x in (q, k, v))
    want = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=allowed, scale=hn**-0.5).transpose(0, 1)
    want = want.reshape(n, 1, heads * hn)
    assert torch.allclose(got, want, atol=1e-12)
    w = torch.randn_like(want)
    g_got = torch.autograd.grad((got * w).sum(), (q, k, v))
    g_want = torch.autograd.grad((want * w).sum(), (q, k, v))
    for a, b in zip(g_got, g_want, strict=True):
        assert torch.allclose(a, b, atol=1e-12)
    assert allowed[10, 5] and not allowed[10, 6] and allowed[12, 11] and not allowed[19, 10]


def test_packing_keeps_every_row_once_and_every_label_in_place():
    """Host-side: each follower's left-out rows are its root's (same tokens, same positions), its
    labels and value rows point where the plain packing's do, and asking for more micro-batches
    than there are groups still gives that many."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from megatron_shared_prefix_worker import records

    from agent_r1.learner.batch import LearnerBatch
    from agent_r1.records.schema import records_to_table

    batch = LearnerBatch.from_table(records_to_table(records(500)))
    (plain,) = batch.micro_batches(None, 10_000)
    (shared,) = batch.micro_batches(None, 10_000, share_prefix=8)
    assert torch.equal(shared.tokens[shared.label_pos], plain.tokens[plain.label_pos])
    assert torch.equal(shared.tokens[shared.label_rows], plain.tokens[plain.label_rows])
    assert torch.equal(shared.positions[shared.label_rows], plain.positions[plain.label_rows])
    assert torch.equal(shared.tokens[shared.step_value_pos], plain.tokens[plain.step_value_pos])
    assert shared.num_tokens < plain.num_tokens
    assert len(batch.micro_batches(None, 10_000, share_prefix=8, count=5)) == 5  # 3 groups, 12 trajectories
