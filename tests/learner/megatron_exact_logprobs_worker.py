"""One rank: two-step episodes sampled by the batch-invariant engine (float32, its own threads),
their action logprobs recomputed by the Megatron actor with and without the engine's ``Scorer`` as
the source of its logprob values; a PPO step on them; the new weights pushed and sampled again."""

import json

import torch
from megatron_rank import init_rank, rank_argv


def episodes(engine, tokenizer, version: int):
    """4 prompts x 2 samples, two steps each in append mode (the second observation extends the
    first with the action and a feedback); every action sampled with its own seed."""
    from agent_r1.records.schema import StepRecord

    records = []
    for p in range(4):
        prompt = tokenizer.encode(f"question {p}: what is {p + 3} plus {7 * p}?" * (1 + p % 2))
        for s in range(2):
            tid, obs, prefix = f"v{version}-p{p}-s{s}", prompt, 0
            for step in range(2):
                seed = 1000 * version + 100 * p + 10 * s + step
                sampling = {
                    "temperature": 1.0,
                    "max_new_tokens": 10,
                    "sampling_seed": seed,
                    "ignore_eos": True,
                }
                (req,) = engine.generate_sync(obs, sampling, return_logprob=True)
                action = list(req.out_ids)
                records.append(
                    StepRecord(
                        tid, f"v{version}-p{p}", step, list(obs), action, list(req.out_logprobs),
                        [1] * len(action), version, prefix, reward=float(s) if step else None, done=step == 1,
                    )
                )  # fmt: skip
                prefix = len(obs) + len(action)
                obs = obs + action + tokenizer.encode(f" result {seed % 97}.")
    return records


def main() -> None:
    rank, world, port, model_dir, out = rank_argv()
    init_rank(rank, world, port)
    import megatron.core  # noqa: F401
    from megatron.core import parallel_state as ps
    from transformers import AutoTokenizer

    from agent_r1.engines.embedded.engine import Engine
    from agent_r1.engines.embedded.scorer import Scorer
    from agent_r1.learner.actor import Actor
    from agent_r1.learner.actor_steps import PolicyTargets
    from agent_r1.learner.backend.cpu_compat import apply
    from agent_r1.learner.batch import LearnerBatch
    from agent_r1.learner.optim import OptimConfig
    from agent_r1.records.schema import records_to_table
    from megatron_bridge import BridgeConfig

    apply()
    ps.initialize_model_parallel(1, 1)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = Engine(model_dir, max_running=16, max_len=512, batch_invariant=True, threads=2)
    engine.start()
    optim = OptimConfig(lr=5e-3, clip_grad=1.0, micro_tokens=160)
    exact = Actor(model_dir, BridgeConfig(), optim, logprob_values=Scorer(model_dir, "float32", 1.0))
    plain = Actor(model_dir, BridgeConfig(), optim)
    results = {}
    try:

        def compare(actor, version: int):
            batch = LearnerBatch.from_table(records_to_table(episodes(engine, tokenizer, version)))
            micro = batch.micro_batches(None, 160)
            lp = actor.logprobs(micro, batch.num_action_tokens)
            return batch, micro, lp, batch.rollout_logprobs

        batch, micro, lp, ref = compare(exact, 0)
        results["micro_batches"] = len(micro)
        results["exact_equal"] = float((lp == ref).float().mean())
        # shared prefixes (a sample's prompt rows left out, its branch continuing its group's root):
        # the engine is given every branch written out whole, so the values are its bits again
        shared = batch.micro_batches(None, 160, share_prefix=8)
        results["shared_branches"] = sum(pl > 0 for mb in shared for _, pl in mb.parents or [])
        results["shared_exact_equal"] = float(
            (exact.logprobs(shared, batch.num_action_tokens) == ref).float().mean()
        )
        _, _, lp_plain, _ = compare(plain, 0)
        results["plain_equal"] = float((lp_plain == ref).float().mean())
        results["plain_max_diff"] = float((lp_plain - ref).abs().max())
        # a PPO step against the engine's own logprobs: every ratio exactly 1 in the first pass
        g = torch.Generator().manual_seed(0)
        adv = batch.per_token((torch.randint(0, 2, (batch.num_steps,), generator=g) * 2 - 1).float())
        m_exact, seen = exact.train_step(micro, PolicyTargets(adv, ref.clone()), "ppo")
        m_plain, seen_plain = plain.train_step(micro, PolicyTargets(adv, ref.clone()), "ppo")
        results["exact_step"] = {k: m_exact[k] for k in ("approx_kl", "clipfrac", "grad_norm")}
        results["plain_step"] = {k: m_plain[k] for k in ("approx_kl", "clipfrac", "grad_norm")}
        results["exact_ratio_dev"] = float((torch.exp(seen - ref) - 1).abs().max())
        results["plain_ratio_dev"] = float((torch.exp(seen_plain - ref) - 1).abs().max())
        # the updated weights pushed to the engine: the learner follows them (its copy re-sent once)
        engine.update_weights(dict(exact.export_hf()), version="1")
        _, _, lp1, ref1 = compare(exact, 1)
        results["after_update_equal"] = float((lp1 == ref1).float().mean())
        # the first batch again under the new weights: other values (the scorer was re-sent them)
        results["old_batch_changed"] = float(
            (exact.logprobs(micro, batch.num_action_tokens) != lp).float().mean()
        )
    finally:
        engine.stop()
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
