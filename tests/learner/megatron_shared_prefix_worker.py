"""One rank: GRPO-shaped records (3 prompts that share a system prompt x 4 samples, half of the
trajectories with a second step in append mode) through the Megatron actor, packed plainly and with
shared prefixes: the logprobs, a PPO step's gradient norm and the weights after it."""

import json

import torch
from megatron_rank import init_rank, rank_argv


def records(vocab: int):
    from agent_r1.records.schema import StepRecord

    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()  # noqa: E731
    system = rand(30)
    out = []
    for p in range(3):
        prompt = system + rand(5 + 4 * p)
        for s in range(4):
            tid, obs, prefix = f"p{p}-s{s}", prompt, 0
            steps = 2 if s % 2 else 1
            for step in range(steps):
                action = rand(3 + (s + step) % 4)
                out.append(
                    StepRecord(
                        tid, f"p{p}", step, list(obs), action, [-1.0] * len(action), [1] * len(action), 0,
                        prefix, reward=float(s == 1) if step == steps - 1 else None, done=step == steps - 1,
                    )
                )  # fmt: skip
                prefix = len(obs) + len(action)
                obs = obs + action + rand(4)
    return out


def main() -> None:
    rank, world, port, model_dir, out = rank_argv()
    init_rank(rank, world, port)
    import megatron.core  # noqa: F401
    from megatron.core import parallel_state as ps
    from transformers import AutoConfig

    from agent_r1.learner.actor import Actor
    from agent_r1.learner.actor_steps import PolicyTargets
    from agent_r1.learner.backend.cpu_compat import apply
    from agent_r1.learner.batch import LearnerBatch
    from agent_r1.learner.optim import OptimConfig
    from agent_r1.records.schema import records_to_table
    from megatron_bridge import BridgeConfig

    apply()
    ps.initialize_model_parallel(1, 1)
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    batch = LearnerBatch.from_table(records_to_table(records(vocab)))
    plain = batch.micro_batches(None, 400)
    shared = batch.micro_batches(None, 400, share_prefix=8)
    results = {
        "plain_tokens": sum(mb.num_tokens for mb in plain),
        "shared_tokens": sum(mb.num_tokens for mb in shared),
        "stream_tokens": batch.num_stream_tokens,
        "shared_micro_batches": len(shared),
        "branches": sum(pl > 0 for mb in shared for _, pl in (mb.parents or [])),
    }
    optim = OptimConfig(lr=1e-3, clip_grad=100.0, micro_tokens=400)
    adv = batch.per_token(torch.tensor([1.0, -1.0] * (batch.num_steps // 2) + [1.0] * (batch.num_steps % 2)))
    weights, lps, steps = {}, {}, {}
    for name, micro in (("plain", plain), ("shared", shared)):
        actor = Actor(model_dir, BridgeConfig(), optim)
        lps[name] = actor.logprobs(micro, batch.num_action_tokens)
        denom = float(
            batch.trainable_per_step.sum()
        )  # token-mean over the whole batch (as the trainer passes it)
        m, _ = actor.train_step(micro, PolicyTargets(adv, lps[name].clone()), "grpo", denom=denom)
        steps[name] = m["grad_norm"]
        weights[name] = dict(actor.export_hf())
    results["logprob_max_diff"] = float((lps["plain"] - lps["shared"]).abs().max())
    results["logprob_scale"] = float(lps["plain"].abs().mean())
    results["grad_norms"] = [steps["plain"], steps["shared"]]
    results["weight_max_diff"] = max(
        float((weights["plain"][k] - weights["shared"][k]).abs().max()) for k in weights["plain"]
    )
    start = dict(Actor(model_dir, BridgeConfig(), optim).export_hf())
    results["weight_max_change"] = max(float((weights["plain"][k] - w).abs().max()) for k, w in start.items())
    # the two updates as whole vectors: |u_shared - u_plain| / |u_plain|
    diff = sum(float((weights["plain"][k] - weights["shared"][k]).double().square().sum()) for k in start)
    step = sum(float((weights["plain"][k] - w).double().square().sum()) for k, w in start.items())
    results["update_rel_diff"] = (diff / step) ** 0.5
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
