"""One rank of the context-parallel checks (2 gloo ranks): each sequence of every micro-batch
split over the two CP ranks (two chunks each, TE's THD layout), attention over both ranks' keys.
The actor's logprobs at CP 2 equal per-step recomputation with the HF model; a PPO step at CP 2
has the gradient norm of the same step at DP 2 (each DP rank with the whole batch); a critic at
CP 2 gives CP 1's values after two steps and the same next gradient norm; a checkpoint written at
CP 2 resumes at CP 1 with the same loss."""

import torch
from megatron_rank import (
    batch_loss,
    finish,
    gather_first,
    init_rank,
    per_step_logprobs,
    rank_argv,
    synth_batch,
)


def main() -> None:
    rank, world, port, model_dir, ckpt, out = rank_argv()
    torch.set_num_threads(1)  # the HF reference first, before the process group and the CPU patches
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    batch = synth_batch(hf.config.vocab_size, n=4, seed=1, max_steps=5, longer=True)
    ref = per_step_logprobs(hf, batch.table)
    init_rank(rank, world, port)
    import megatron.core  # noqa: F401
    from megatron.core import parallel_state as ps

    from agent_r1.learner.actor import Actor
    from agent_r1.learner.actor_steps import PolicyTargets
    from agent_r1.learner.backend.cpu_compat import apply
    from agent_r1.learner.critic import Critic
    from agent_r1.learner.optim import OptimConfig
    from megatron_bridge import BridgeConfig

    apply()
    micro = batch.micro_batches(None, 40)
    g = torch.Generator().manual_seed(0)
    adv = batch.per_token((torch.randint(0, 2, (batch.num_steps,), generator=g) * 2 - 1).float())
    optim = OptimConfig(lr=5e-3, clip_grad=1.0, micro_tokens=40)
    returns = torch.linspace(
        -0.5, 1, batch.num_steps
    )  # (a sum of 0 would leave the bias a gradient of float noise, which Adam turns into a whole step)
    results = {"micro_batches": len(micro)}
    for cp in (2, 1):  # CP 2, then CP 1 = DP 2 with the same batch on both ranks
        ps.initialize_model_parallel(context_parallel_size=cp)
        actor = Actor(model_dir, BridgeConfig(cp=cp), optim)
        lp = actor.logprobs(micro, batch.num_action_tokens)
        results[f"cp{cp}_lp_diff"] = gather_first(float((lp.double() - ref).abs().max()), world)
        targets = PolicyTargets(adv, lp)
        if cp == 2:
            rows = [len(mb.cp.rows) for mb in actor._shard(micro)]
            results["cp2_rows"], results["cp2_stream"] = rows, [mb.num_tokens for mb in micro]
        metrics, _ = actor.train_step(micro, PolicyTargets(adv), "ppo")
        results[f"cp{cp}_grad_norm"] = metrics["grad_norm"]
        results[f"cp{cp}_loss"] = batch_loss(actor, batch, micro, targets)
        if cp == 2:
            actor.save(ckpt, {})
        else:
            fresh = Actor(model_dir, BridgeConfig(), optim)
            fresh.load(ckpt)
            results["resumed_cp1_loss"] = batch_loss(fresh, batch, micro, targets)
        critic = Critic(model_dir, BridgeConfig(cp=cp), OptimConfig(lr=3e-3, micro_tokens=40))
        for _ in range(2):
            critic.train_step(micro, returns)
        results[f"cp{cp}_values"] = gather_first(critic.values(micro, batch.num_steps).tolist(), world)
        results[f"cp{cp}_critic_grad_norm"] = critic.train_step(micro, returns)["grad_norm"]
        ps.destroy_model_parallel()
    finish(rank, results, out)


if __name__ == "__main__":
    main()
