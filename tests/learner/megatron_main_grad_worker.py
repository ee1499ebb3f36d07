"""One rank: two train steps of a bf16 actor with the native main-gradient add
(``learner/main_grad``) and of the same actor with upstream's add alone: the same gradient norm at
each step and the same parameters after both."""

import torch
from megatron_rank import finish, init_rank, ppo_setup, rank_argv


def main() -> None:
    rank, world, port, model_dir, out = rank_argv()
    init_rank(rank, world, port)
    from megatron.core import parallel_state as ps

    from agent_r1.learner.actor import Actor
    from agent_r1.learner.actor_steps import PolicyTargets
    from agent_r1.learner.backend import main_grad
    from megatron_bridge import BridgeConfig

    batch, micro, adv, optim = ppo_setup(model_dir)
    ps.initialize_model_parallel(1, 1)
    native_add = main_grad.accumulate
    added: list[tuple[int, ...]] = []

    def counted(m, g):
        done = native_add(m, g)
        if done:
            added.append(tuple(g.shape))
        return done

    results = {}
    for mode, add in (("native", counted), ("upstream", lambda m, g: False)):
        main_grad.accumulate = add
        actor = Actor(model_dir, BridgeConfig(dtype="bfloat16"), optim)
        targets = PolicyTargets(adv, actor.logprobs(micro, batch.num_action_tokens))
        norms = [actor.train_step(micro, targets, "ppo")[0]["grad_norm"] for _ in range(2)]
        params = {n: p.detach().float().clone() for n, p in actor.chunks[0].module.named_parameters()}
        embedding = tuple(actor.chunks[0].module.embedding.word_embeddings.weight.shape)
        results[mode] = (norms, params)
    main_grad.accumulate = native_add
    (n_norms, n_params), (u_norms, u_params) = results["native"], results["upstream"]
    names = sorted(n_params)
    finish(
        rank,
        {
            "native_adds": len(added),
            "embedding_added": embedding in added,  # the tied embedding/output weight
            "params": len(names),
            "grad_norms": [n_norms, u_norms],
            "unequal": [n for n in names if not torch.equal(n_params[n], u_params[n])],
            "changed": sum(not torch.equal(n_params[n], u_params[n]) for n in names),
        },
        out,
    )


if __name__ == "__main__":
    main()
