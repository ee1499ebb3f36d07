"""One rank of the MoE learner checks: PPO steps on a fixed batch with the experts spread over two
ranks (EP 2, DP 2) reduce the loss; the checkpoint (Megatron's dist_checkpointing) resumes at
EP 2, with every expert on each rank (EP 1), at TP 2 with sequence parallelism and over two
pipeline stages with the same next loss; a step from it at EP 1 (DP 2) and at TP 2 with sequence
parallelism has the same gradient norm (the norms' and router's gradients, which each TP rank
holds for its half of the tokens, summed by Megatron's finalize_model_grads)."""

from megatron_rank import batch_loss, finish, init_rank, ppo_setup, rank_argv

LAYOUTS = {"ep2": (1, 1, 2), "ep1": (1, 1, 1), "tp2sp": (2, 1, 2), "pp2": (1, 2, 1)}  # tp, pp, ep


def main() -> None:
    rank, world, port, model_dir, ckpt, out = rank_argv()
    init_rank(rank, world, port)
    import megatron.core  # noqa: F401
    from megatron.core import parallel_state as ps

    from agent_r1.learner.actor import Actor, PolicyTargets
    from megatron_bridge import BridgeConfig

    batch, micro, adv, optim = ppo_setup(model_dir)

    def init(tp: int, pp: int, ep: int) -> None:
        ps.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep, expert_tensor_parallel_size=1)

    init(1, 1, 2)
    actor = Actor(model_dir, BridgeConfig(ep=2), optim)
    targets = PolicyTargets(adv, actor.logprobs(micro, batch.num_action_tokens))

    def loss(a):
        return batch_loss(a, batch, micro, targets)

    losses = [loss(actor)]
    for _ in range(3):
        actor.train_step(micro, targets, "ppo")
        losses.append(loss(actor))
    results = {
        "losses": losses,
        "local_experts": len(actor.module.decoder.layers[0].mlp.experts.local_experts),
    }
    actor.save(ckpt, {})
    results["saved"] = loss(actor)
    ps.destroy_model_parallel()
    halves = batch.micro_batches(None, 40, pad_to=2)  # sequence parallel: streams split in two
    for layout, (tp, pp, ep) in LAYOUTS.items():
        init(tp, pp, ep)
        a = Actor(model_dir, BridgeConfig(tp=tp, pp=pp, ep=ep, sp=tp > 1), optim)
        a.load(ckpt)
        mb = halves if layout in ("ep1", "tp2sp") else micro  # padded alike: pads pass the router too
        results[f"resumed_{layout}"] = batch_loss(a, batch, mb, targets)
        if layout in ("ep1", "tp2sp"):
            # on-policy (ratio 1): no token sits at a clip boundary that float noise could cross
            metrics, _ = a.train_step(mb, PolicyTargets(adv), "ppo")
            results[f"grad_norm_{layout}"] = metrics["grad_norm"]
        ps.destroy_model_parallel()
    finish(rank, results, out)


if __name__ == "__main__":
    main()
