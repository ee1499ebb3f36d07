"""One rank of the learner checks: PPO steps on a fixed batch reduce the loss at DP2, TP2 and PP2;
a checkpoint saved at TP1 (DP2) resumes at TP2 and at PP2 with the identical next-step loss."""

import sys

import torch
from megatron_rank import finish, gather_first, init_rank, synth_trajectories


def batch_loss(actor, batch):
    """Loss value of the batch under the current weights (forward only, same formula as training)."""
    from agent_r1.algos.losses import LossInputs, loss_config, policy_loss

    lps = actor.logprobs(batch.trajectories)
    out = [None]
    if lps is not None:
        lp = torch.tensor([v for s in lps for v in s])
        old = torch.tensor([v for s in batch.old_logprobs for v in s])
        step = torch.tensor([i for i, s in enumerate(lps) for _ in s])
        adv = torch.tensor(batch.advantages)[step]
        loss, _ = policy_loss(
            "ppo",
            LossInputs(lp, old, adv, torch.ones_like(lp, dtype=torch.bool), step, len(lps)),
            loss_config("ppo"),
        )
        out = [float(loss)]
    return gather_first(out[0])


def main() -> None:
    rank, world, port, model_dir, ckpt, out = (
        int(sys.argv[1]),
        int(sys.argv[2]),
        sys.argv[3],
        sys.argv[4],
        sys.argv[5],
        sys.argv[6],
    )
    init_rank(rank, world, port)
    import megatron.core  # noqa: F401
    from megatron.core import parallel_state as ps
    from transformers import AutoConfig

    from agent_r1.learner.actor import Actor, OptimConfig, StepBatchForLearner
    from agent_r1.learner.cpu_compat import apply
    from megatron_bridge import BridgeConfig

    apply()
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    trajs = synth_trajectories(vocab, seed=2)
    g = torch.Generator().manual_seed(0)
    n_steps = sum(len(x) for x in trajs)
    adv = (torch.randint(0, 2, (n_steps,), generator=g) * 2 - 1).float().tolist()
    results = {}
    optim = OptimConfig(lr=5e-3, clip_grad=1.0, micro_tokens=40)

    # DP2 (TP1, PP1): train, checkpoint
    ps.initialize_model_parallel(1, 1)
    actor = Actor(model_dir, BridgeConfig(), optim)
    old = actor.logprobs(trajs)
    batch = StepBatchForLearner(trajs, old, adv)
    losses = [batch_loss(actor, batch)]
    first_metrics = None
    for _ in range(3):
        step_metrics = actor.train_step(batch, "ppo")
        first_metrics = first_metrics or step_metrics
        losses.append(batch_loss(actor, batch))
    results["dp2_losses"] = losses
    results["dp2_metrics"] = {
        k: first_metrics[k] for k in ("grad_norm", "lr", "clipfrac", "approx_kl") if k in first_metrics
    }
    actor.save(ckpt, {"data_cursor": 7})
    results["next_loss_saved"] = batch_loss(actor, batch)
    same = Actor(model_dir, BridgeConfig(), optim)
    results["trainer_state"] = same.load(ckpt)
    results["next_loss_reloaded_same_layout"] = batch_loss(same, batch)
    from agent_r1.learner.actor import _torch_optimizers

    def opt_state(a):
        o = _torch_optimizers(a.optimizer)[0]
        p = o.param_groups[0]["params"][0]
        st = o.state[p]
        return [
            float(o.param_groups[0]["lr"]),
            float(st["step"]),
            float(st["exp_avg"].abs().sum()),
            float(st["exp_avg_sq"].abs().sum()),
        ]

    results["opt_state"] = [opt_state(actor), opt_state(same)]
    same.train_step(batch, "ppo")
    actor.train_step(batch, "ppo")
    results["after_step_same"] = [batch_loss(actor, batch), batch_loss(same, batch)]
    ps.destroy_model_parallel()

    for layout in ("2x1", "1x2"):
        tp, pp = map(int, layout.split("x"))
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        a = Actor(model_dir, BridgeConfig(tp=tp, pp=pp), optim)
        a.load(ckpt)
        results[f"next_loss_{layout}"] = batch_loss(a, batch)
        fresh = Actor(model_dir, BridgeConfig(tp=tp, pp=pp), optim)
        fresh_old = fresh.logprobs(trajs)  # collective: every rank runs the schedule
        # every rank needs the old logprobs: take them from the last stage
        b2 = StepBatchForLearner(trajs, gather_first(fresh_old), adv)
        ls = [batch_loss(fresh, b2)]
        for _ in range(3):
            fresh.train_step(b2, "ppo")
            ls.append(batch_loss(fresh, b2))
        results[f"losses_{layout}"] = ls
        ps.destroy_model_parallel()
    finish(rank, results, out)


if __name__ == "__main__":
    main()
