"""One rank of the MoE learner checks: PPO steps on a fixed batch with the experts spread over two
ranks (EP 2, DP 2) reduce the loss; the checkpoint (Megatron's dist_checkpointing) resumes at
EP 2, with every expert on each rank (EP 1), at TP 2 with sequence parallelism, over two pipeline
stages and over two ranks of two virtual stages each with the same next loss; a step from it at
EP 1 (DP 2), at TP 2 with sequence parallelism (the norms' and router's gradients, which each TP
rank holds for its half of the tokens, summed by Megatron's finalize_model_grads) and through the
interleaved schedule has the same gradient norm."""

from megatron_rank import batch_loss, finish, init_rank, ppo_setup, rank_argv

# tp, pp, ep, vpp
LAYOUTS = {
    "ep2": (1, 1, 2, 1),
    "ep1": (1, 1, 1, 1),
    "tp2sp": (2, 1, 2, 1),
    "pp2": (1, 2, 1, 1),
    "pp2vpp2": (1, 2, 1, 2),
}
STEPPED = ("ep1", "tp2sp", "pp2vpp2")  # one step each from the checkpoint, on the same micro-batches


def main() -> None:
    rank, world, port, model_dir, ckpt, out = rank_argv()
    init_rank(rank, world, port)
    import megatron.core  # noqa: F401
    from megatron.core import parallel_state as ps

    from agent_r1.learner.actor import Actor
    from agent_r1.learner.actor_steps import PolicyTargets
    from megatron_bridge import BridgeConfig

    batch, micro, adv, optim = ppo_setup(model_dir)

    def init(tp: int, pp: int, ep: int, vpp: int = 1) -> None:
        ps.initialize_model_parallel(
            tp,
            pp,
            virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=1,
        )

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
    # streams in halves (sequence parallel), an even number of them (virtual stages: groups of
    # pp); the stepped layouts share them (padding passes the router too)
    even = batch.micro_batches(None, 40, pad_to=2, count=-(-len(micro) // 2) * 2)
    for layout, (tp, pp, ep, vpp) in LAYOUTS.items():
        init(tp, pp, ep, vpp)
        a = Actor(model_dir, BridgeConfig(tp=tp, pp=pp, ep=ep, sp=tp > 1, vpp=vpp), optim)
        a.load(ckpt)
        mb = even if layout in STEPPED else micro
        results[f"resumed_{layout}"] = batch_loss(a, batch, mb, targets)
        if layout in STEPPED:
            # on-policy (ratio 1): no token sits at a clip boundary that float noise could cross
            metrics, _ = a.train_step(mb, PolicyTargets(adv), "ppo")
            results[f"grad_norm_{layout}"] = metrics["grad_norm"]
        ps.destroy_model_parallel()
    finish(rank, results, out)


if __name__ == "__main__":
    main()
