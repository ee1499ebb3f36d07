"""One rank of the critic/reference checks: value regression lowers the value loss at DP2, TP2 and
PP2; prefix-merged step-start values equal per-step computation; a frozen reference policy gives
the actor's initial logprobs."""

from pathlib import Path

import pyarrow as pa
import torch
from megatron_rank import finish, gather_first, init_rank, layouts, rank_argv, synth_batch, synth_records


def _list(x):
    return None if x is None else x.tolist()


def main() -> None:
    rank, world, port, model_dir, out = rank_argv()
    init_rank(rank, world, port)
    import megatron.core  # noqa: F401
    from megatron.core import parallel_state as ps
    from transformers import AutoConfig

    from agent_r1.learner.actor import Actor
    from agent_r1.learner.backend.cpu_compat import apply
    from agent_r1.learner.critic import Critic
    from agent_r1.learner.optim import OptimConfig
    from megatron_bridge import BridgeConfig

    apply()
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    from agent_r1.learner.batch import LearnerBatch

    batch = synth_batch(vocab, seed=5)
    t = synth_records(vocab, seed=5)  # the same records with prefix_len 0: every step its own sequence
    split = LearnerBatch.from_table(t.set_column(t.column_names.index("prefix_len"), "prefix_len",
                                                 pa.array([0] * t.num_rows, pa.int32())))  # fmt: skip
    micro, micro_split = batch.micro_batches(None, 40), split.micro_batches(None, 40)
    n = batch.num_steps
    returns = torch.linspace(-1, 1, n)
    results = {"sequences": [sum(len(mb.bounds) for mb in m) for m in (micro, micro_split)]}
    for layout, tp, pp in layouts():
        critic = Critic(model_dir, BridgeConfig(tp=tp, pp=pp), OptimConfig(lr=3e-3, micro_tokens=40))
        losses = [critic.train_step(micro, returns)["value_loss"] for _ in range(6)]
        results[f"value_losses_{layout}"] = gather_first(
            losses if ps.is_pipeline_last_stage() else None, world
        )
        v_merged = gather_first(_list(critic.values(micro, n)), world)
        v_split = gather_first(_list(critic.values(micro_split, n)), world)
        results[f"value_merge_diff_{layout}"] = max(
            abs(a - b) for a, b in zip(v_merged, v_split, strict=True)
        )
        results[f"values_nonzero_{layout}"] = max(abs(a) for a in v_merged)
        # resume: a fresh critic loading the checkpoint gives the same values and the same next step
        ckpt = Path(out).parent / f"critic_{layout}"
        critic.save(ckpt, {})
        fresh = Critic(model_dir, BridgeConfig(tp=tp, pp=pp), OptimConfig(lr=3e-3, micro_tokens=40))
        fresh.load(ckpt)
        v_fresh = gather_first(_list(fresh.values(micro, n)), world)
        results[f"resume_value_diff_{layout}"] = max(
            abs(a - b) for a, b in zip(v_merged, v_fresh, strict=True)
        )
        nxt = [c.train_step(micro, returns)["value_loss"] for c in (critic, fresh)]
        results[f"resume_next_loss_{layout}"] = gather_first(
            nxt if ps.is_pipeline_last_stage() else None, world
        )
        actor = Actor(model_dir, BridgeConfig(tp=tp, pp=pp), OptimConfig())
        ref = Actor(model_dir, BridgeConfig(tp=tp, pp=pp), OptimConfig(), trainable=False)
        a_lp = gather_first(_list(actor.logprobs(micro, batch.num_action_tokens)), world)
        r_lp = gather_first(_list(ref.logprobs(micro, batch.num_action_tokens)), world)
        results[f"ref_diff_{layout}"] = max(abs(x - y) for x, y in zip(a_lp, r_lp, strict=True))
    # sequence parallelism (TP 2): the value head reads the gathered stream; the values after two
    # steps (the first moves only the zero-initialised head, the second the backbone too) and the
    # third step's gradient equal TP 2's without it (on streams padded to halves for both)
    halves = batch.micro_batches(None, 40, pad_to=2)
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    for sp in (False, True):
        c = Critic(model_dir, BridgeConfig(tp=2, sp=sp), OptimConfig(lr=3e-3, micro_tokens=40))
        for _ in range(2):
            c.train_step(halves, returns)
        results[f"sp{sp:d}_values"] = gather_first(_list(c.values(halves, n)), world)
        results[f"sp{sp:d}_grad_norm"] = c.train_step(halves, returns)["grad_norm"]
    ps.destroy_model_parallel()
    finish(rank, results, out)


if __name__ == "__main__":
    main()
