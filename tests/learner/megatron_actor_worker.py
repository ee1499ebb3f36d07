"""One rank of the learner checks: PPO steps on a fixed batch reduce the loss at DP2, TP2 and PP2;
a checkpoint saved at TP1 (DP2) resumes at TP2 and at PP2 with the identical next-step loss."""

import torch
from megatron_rank import batch_loss, finish, gather_first, init_rank, ppo_setup, rank_argv


def main() -> None:
    rank, world, port, model_dir, ckpt, out = rank_argv()
    init_rank(rank, world, port)
    import megatron.core  # noqa: F401
    from megatron.core import parallel_state as ps

    from agent_r1.learner.actor import Actor
    from agent_r1.learner.actor_steps import PolicyTargets
    from megatron_bridge import BridgeConfig

    batch, micro, adv, optim = ppo_setup(model_dir)
    results = {"micro_batches": len(micro)}

    # DP2 (TP1, PP1): train, checkpoint
    ps.initialize_model_parallel(1, 1)
    actor = Actor(model_dir, BridgeConfig(), optim)
    targets = PolicyTargets(adv, actor.logprobs(micro, batch.num_action_tokens))

    def loss(a, t=targets):
        return batch_loss(a, batch, micro, t)

    losses = [loss(actor)]
    first_metrics = None
    for _ in range(3):
        step_metrics, _ = actor.train_step(micro, targets, "ppo")
        first_metrics = first_metrics or step_metrics
        losses.append(loss(actor))
    results["dp2_losses"] = losses
    results["dp2_metrics"] = {
        k: first_metrics[k] for k in ("grad_norm", "lr", "clipfrac", "approx_kl") if k in first_metrics
    }
    actor.save(ckpt, {"data_cursor": 7})
    results["next_loss_saved"] = loss(actor)
    same = Actor(model_dir, BridgeConfig(), optim)
    results["trainer_state"] = same.load(ckpt)
    results["next_loss_reloaded_same_layout"] = loss(same)
    from agent_r1.learner.optim import torch_optimizers

    def opt_state(a):
        o = torch_optimizers(a.optimizer)[0]
        p = o.param_groups[0]["params"][0]
        st = o.state[p]
        return [
            float(o.param_groups[0]["lr"]),
            float(st["step"]),
            float(st["exp_avg"].abs().sum()),
            float(st["exp_avg_sq"].abs().sum()),
            all(g["fused"] for g in o.param_groups),  # torch's one-pass Adam kernel (CPU and CUDA)
        ]

    results["opt_state"] = [opt_state(actor), opt_state(same)]
    same.train_step(micro, targets, "ppo")
    actor.train_step(micro, targets, "ppo")
    results["after_step_same"] = [loss(actor), loss(same)]
    ps.destroy_model_parallel()

    for layout in ("2x1", "1x2"):
        tp, pp = map(int, layout.split("x"))
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        a = Actor(model_dir, BridgeConfig(tp=tp, pp=pp), optim)
        a.load(ckpt)
        # the loss of the DP2 run's targets (every rank needs them: take the last stage's)
        results[f"next_loss_{layout}"] = loss(a)
        fresh = Actor(model_dir, BridgeConfig(tp=tp, pp=pp), optim)
        fresh_old = fresh.logprobs(micro, batch.num_action_tokens)  # None before the last stage
        t2 = PolicyTargets(adv, gather_first(None if fresh_old is None else fresh_old.tolist()))
        t2.old_logprobs = torch.tensor(t2.old_logprobs)
        ls = [loss(fresh, t2)]
        for _ in range(3):
            fresh.train_step(micro, t2, "ppo")
            ls.append(loss(fresh, t2))
        results[f"losses_{layout}"] = ls
        ps.destroy_model_parallel()
    finish(rank, results, out)


if __name__ == "__main__":
    main()
