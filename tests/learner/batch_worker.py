"""One rank of the LearnerBatch checks.

``compare``: for several algorithms, two learners with the same initial weights update on the
same records, one through ``Learner.update`` (the columnar batch) and one through the frozen list
path; the metrics (losses, advantages, critic loss, grad norm) and every parameter's gradient of
the last optimizer step are written for the test to compare.
``dp``: the same records as one rank (world 1) or split by group over two ranks: the last step's
gradients, which must not depend on the split (data-parallel-global loss denominator).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))

from megatron_rank import finish, init_rank  # noqa: E402

CONFIGS = {
    "grpo": ["algorithm=grpo"],
    "steppo_minibatches": ["algorithm=steppo", "algorithm.mini_batches=2", "algorithm.epochs=2"],
    "ppo_critic_kl": [
        "algorithm=ppo",
        "algorithm.reference=true",
        "algorithm.policy.kl_coef=0.05",
        "algorithm.mini_batches=2",
    ],
    "opd_token_level": ["algorithm=opd"],
    "rloo_masked_seq_mean": [
        "algorithm=grpo",
        "algorithm.advantage=rloo",
        "algorithm.policy.agg=seq-mean-token-sum",
    ],
}


def learner(model_dir: str, overrides: list[str]):
    from agent_r1.train.config import load_config
    from agent_r1.train.learner_rank import Learner

    cfg = load_config(
        [f"model.path={model_dir}", "model.build=null", "trainer.progress=false", "optim.micro_tokens=96",
         "optim.lr=1e-3", "optim.clip_grad=1e9", *overrides]
    )  # fmt: skip
    return Learner(cfg)


def grads(lr) -> dict[str, list[float]]:
    out = {}
    for name, p in lr.actor.module.named_parameters():
        out[name] = p.main_grad.flatten().tolist()
    if lr.critic is not None:
        for name, p in lr.critic.module.named_parameters():
            out["critic." + name] = p.main_grad.flatten().tolist()
    return out


def table(vocab: int, masked: bool):
    """Synthetic multi-step records; with ``masked`` about 2% of the action tokens have mask 0,
    else every token is trainable (the list path counted mask-0 tokens in the denominator)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from agent_r1.records.synth import synth_table

    t = synth_table(12, group_size=4, max_steps=4, seed=3, prompt_len=(6, 14), action_len=(2, 8),
                    feedback_len=(1, 5), vocab=vocab)  # fmt: skip
    if masked:
        return t
    col = t.column("action_mask").combine_chunks()
    ones = pa.ListArray.from_arrays(col.offsets, pa.array(np.ones(len(pc.list_flatten(col)), np.int8)))
    return t.set_column(t.column_names.index("action_mask"), "action_mask", ones)


def main() -> None:
    rank, world, port, mode, model_dir, out = (
        int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6]
    )  # fmt: skip
    init_rank(rank, world, port)
    import list_path
    from megatron.core import parallel_state as ps
    from transformers import AutoConfig

    from agent_r1.learner.backend.cpu_compat import apply

    apply()
    ps.initialize_model_parallel(1, 1)
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    t = table(vocab, masked=mode != "compare")
    results = {}
    if mode == "compare":
        for name, overrides in CONFIGS.items():
            new, old = learner(model_dir, overrides), learner(model_dir, overrides)
            m_new = new.update(t, 1, 0)
            g_new = grads(new)
            m_old = list_path.update(old, t, 1, 0)
            g_old = grads(old)
            results[name] = {"new": m_new, "old": m_old, "grads_new": g_new, "grads_old": g_old}
        # micro-batches padded to multiples of 16 (FP8's alignment): the same update
        plain = learner(model_dir, ["algorithm=grpo", "optim.micro_tokens=64"])
        padded = learner(model_dir, ["algorithm=grpo", "optim.micro_tokens=64", "optim.pad_multiple=16"])
        results["padded"] = {
            "plain": plain.update(t, 1, 0), "padded": padded.update(t, 1, 0),
            "grads_plain": grads(plain), "grads_padded": grads(padded),
        }  # fmt: skip
        # token-level GAE trains its (step-level) critic on the return at each step's first token
        lr = learner(model_dir, ["algorithm=ppo", "algorithm.advantage=token_gae"])
        results["token_gae"] = lr.update(t, 1, 0)
        # mask-0 tokens: the list path divided by all action tokens, the batch by trainable ones
        masked = table(vocab, masked=True)
        new, old = learner(model_dir, ["algorithm=grpo"]), learner(model_dir, ["algorithm=grpo"])
        flat = [x for m in masked.column("action_mask").to_pylist() for x in m]
        results["masked"] = {
            "new": new.update(masked, 1, 0)["loss/pg"],
            "old": list_path.update(old, masked, 1, 0)["loss/pg"],
            "tokens": len(flat),
            "trainable": sum(flat),
        }
    else:  # dp: this rank's share of the groups (all of them at world 1)
        import pyarrow as pa

        gids = t.column("group_id").to_pylist()
        order = sorted(set(gids))  # groups alternate over the ranks (whole groups, as the reader deals them)
        mine = pa.array([i for i, g in enumerate(gids) if order.index(g) % world == rank], pa.int64())
        # the all-reduce optimizer: every rank holds the reduced gradients (not a reduce-scattered shard)
        lr = learner(model_dir, ["algorithm=grpo", "optim.distributed_optimizer=false", *sys.argv[7:]])
        m = lr.update(t.take(mine), 1, 0)
        results = {"metrics": m, "grads": grads(lr), "rows": len(mine)}
    ps.destroy_model_parallel()
    finish(rank, results, out, indent=None)


if __name__ == "__main__":
    main()
