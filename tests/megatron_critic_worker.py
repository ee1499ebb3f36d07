"""One rank of the critic/reference checks: value regression lowers the value loss at DP2, TP2 and
PP2; prefix-merged step-start values equal per-step computation; a frozen reference policy gives
the actor's initial logprobs."""

import sys

import torch
from megatron_rank import finish, gather_first, init_rank, synth_trajectories


def main() -> None:
    rank, world, port, model_dir, out = (
        int(sys.argv[1]),
        int(sys.argv[2]),
        sys.argv[3],
        sys.argv[4],
        sys.argv[5],
    )
    init_rank(rank, world, port)
    import megatron.core  # noqa: F401
    from megatron.core import parallel_state as ps
    from transformers import AutoConfig

    from agent_r1.learner.actor import Actor, OptimConfig
    from agent_r1.learner.cpu_compat import apply
    from agent_r1.learner.critic import Critic
    from megatron_bridge import BridgeConfig

    apply()
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    trajs = synth_trajectories(vocab, seed=5)
    split = [[{**s, "prefix_len": 0}] for steps in trajs for s in steps]  # every step its own sequence
    n = sum(len(x) for x in trajs)
    returns = torch.linspace(-1, 1, n).tolist()
    results = {}
    for layout in ("1x1", "2x1", "1x2"):
        tp, pp = map(int, layout.split("x"))
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        critic = Critic(model_dir, BridgeConfig(tp=tp, pp=pp), OptimConfig(lr=3e-3, micro_tokens=40))
        losses = [critic.train_step(trajs, returns)["value_loss"] for _ in range(6)]
        results[f"value_losses_{layout}"] = gather_first(
            losses if ps.is_pipeline_last_stage() else None, world
        )
        v_merged = gather_first(critic.values(trajs), world)
        v_split = gather_first(critic.values(split), world)
        results[f"value_merge_diff_{layout}"] = max(
            abs(a - b) for a, b in zip(v_merged, v_split, strict=True)
        )
        results[f"values_nonzero_{layout}"] = max(abs(a) for a in v_merged)
        actor = Actor(model_dir, BridgeConfig(tp=tp, pp=pp), OptimConfig())
        ref = Actor(model_dir, BridgeConfig(tp=tp, pp=pp), OptimConfig(), trainable=False)
        a_lp = gather_first(actor.logprobs(trajs), world)
        r_lp = gather_first(ref.logprobs(trajs), world)
        results[f"ref_diff_{layout}"] = max(
            abs(x - y) for sa, sb in zip(a_lp, r_lp, strict=True) for x, y in zip(sa, sb, strict=True)
        )
        ps.destroy_model_parallel()
    finish(rank, results, out)


if __name__ == "__main__":
    main()
