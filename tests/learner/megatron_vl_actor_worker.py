"""One rank of the vision-language actor checks: step records with images (stored once per
trajectory) -> LearnerBatch -> the Actor's logprobs equal transformers' own model step by step;
PPO steps with the tower frozen (it stays as loaded) and trained (it moves, the export carries it);
a checkpoint saved at DP2 resumes at TP2 and PP2 with the same loss."""

import torch
from megatron_rank import batch_loss, finish, gather_first, init_rank, rank_argv
from vision import image_bytes


def records(model_dir):
    """4 two-step trajectories: an image, an action, a second ("zoomed") image, an action."""
    from agent_r1.agent.chat import ChatCodec
    from agent_r1.agent.flow import step_images
    from agent_r1.records.schema import StepRecord
    from agent_r1.vision.images import load_image

    codec = ChatCodec.load(model_dir)
    g = torch.Generator().manual_seed(3)
    pad = codec.image_token_id()
    out = []
    for i in range(4):
        a, b = load_image(image_bytes(90, 60, seed=10 + i)), load_image(image_bytes(56, 112, seed=20 + i))
        ids0, ims0 = codec.encode_chat_images(
            [
                {
                    "role": "user",
                    "content": [{"type": "image", "image": a.data}, {"type": "text", "text": f"Q{i}"}],
                }
            ]
        )

        def action(n):
            return [t for t in torch.randint(3, codec.vocab_size, (n,), generator=g).tolist() if t != pad] + [
                codec.end_id
            ]

        act0, act1 = action(5), action(4)
        turn = codec.encode(codec.render_message("user", codec.image_markup(b) + "zoomed"))
        ids1 = ids0 + act0 + codec.close_action(act0) + turn + codec.generation_prompt_ids
        seen: set[str] = set()
        for t, (obs, act, ims) in enumerate([(ids0, act0, ims0), (ids1, act1, [a, b])]):
            out.append(StepRecord(
                f"t{i}", f"g{i // 2}", t, obs, act, [-1.0] * len(act), [1] * len(act),
                prefix_len=0 if t == 0 else len(ids0) + len(act0), reward=float(i % 2) if t else 0.0,
                done=t == 1, **step_images(ims, seen),
            ))  # fmt: skip
    return out


def hf_reference(model_dir, recs):
    from transformers import AutoModelForImageTextToText

    from agent_r1.vision.qwen2_vl import image_processor, pixel_values

    hf = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float64).eval()
    proc = image_processor(model_dir)
    stored = {h: d for r in recs for h, d in r.image_data.items()}
    from agent_r1.vision.images import load_image

    out = []
    with torch.no_grad():
        for r in recs:
            full = torch.tensor([r.obs_token_ids + r.action_token_ids])
            pv, grid = pixel_values(proc, [load_image(stored[h]) for h in r.images])
            logits = hf(input_ids=full, pixel_values=pv.double(), image_grid_thw=grid,
                        mm_token_type_ids=(full == hf.config.image_token_id).int()).logits[0]  # fmt: skip
            lp = torch.log_softmax(logits.double(), -1)
            n = len(r.obs_token_ids)
            out.append(lp[n - 1 : -1].gather(1, full[0, n:, None])[:, 0])
    return torch.cat(out)


def main() -> None:
    rank, world, port, model_dir, ckpt, out = rank_argv()
    torch.set_num_threads(1)
    from agent_r1.learner.batch import LearnerBatch
    from agent_r1.records.schema import records_to_table
    from agent_r1.vision.qwen2_vl import Geometry

    recs = records(model_dir)
    ref = hf_reference(model_dir, recs)
    batch = LearnerBatch.from_table(records_to_table(recs), vision=Geometry.of(model_dir))
    micro = batch.micro_batches(None, 120)
    results = {"micro_batches": len(micro), "merged": batch.num_stream_tokens < sum(
        len(r.obs_token_ids) + len(r.action_token_ids) for r in recs)}  # fmt: skip

    init_rank(rank, world, port)
    import megatron.core  # noqa: F401
    from megatron.core import parallel_state as ps

    from agent_r1.learner.actor import Actor
    from agent_r1.learner.actor_steps import PolicyTargets
    from agent_r1.learner.backend.cpu_compat import apply
    from agent_r1.learner.optim import OptimConfig
    from megatron_bridge import BridgeConfig

    apply()
    g = torch.Generator().manual_seed(0)
    adv = batch.per_token((torch.randint(0, 2, (batch.num_steps,), generator=g) * 2 - 1).float())
    optim = OptimConfig(lr=5e-3, clip_grad=1.0, micro_tokens=120)

    def loss(a, t):
        return batch_loss(a, batch, micro, t)

    def tower(a):
        enc = a.module.vision_encoder
        return torch.cat([p.detach().flatten() for p in enc.tower.parameters()]).clone()

    for train_vision in (False, True):
        ps.initialize_model_parallel(1, 1)
        actor = Actor(model_dir, BridgeConfig(), optim, train_vision=train_vision)
        lp0 = actor.logprobs(micro, batch.num_action_tokens)
        key = "trained" if train_vision else "frozen"
        results[f"{key}_vs_hf"] = float((lp0.double() - ref).abs().max())
        targets = PolicyTargets(adv, lp0)
        before = tower(actor)
        losses = [loss(actor, targets)]
        for _ in range(3):
            actor.train_step(micro, targets, "ppo")
            losses.append(loss(actor, targets))
        results[f"{key}_losses"] = losses
        results[f"{key}_tower_moved"] = float((tower(actor) - before).abs().max())
        names = [n for n, _ in actor.export_hf()]
        results[f"{key}_exports_visual"] = any(n.startswith("visual.") for n in names)
        sums = [None] * world
        torch.distributed.all_gather_object(sums, float(tower(actor).double().sum()))
        results[f"{key}_tower_same_on_dp_ranks"] = sums[0] == sums[1]
        if train_vision:
            actor.save(ckpt, {"data_cursor": 1})
            results["next_loss_saved"] = loss(actor, targets)
            saved_tower = tower(actor)
            saved_targets = targets
        ps.destroy_model_parallel()
    for layout in ("2x1", "1x2"):
        tp, pp = map(int, layout.split("x"))
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        a = Actor(model_dir, BridgeConfig(tp=tp, pp=pp), optim, train_vision=True)
        a.load(ckpt)
        t = PolicyTargets(
            adv,
            torch.tensor(
                gather_first(
                    None if saved_targets.old_logprobs is None else saved_targets.old_logprobs.tolist()
                )
            ),
        )
        results[f"next_loss_{layout}"] = loss(a, t)
        enc = getattr(a.module, "vision_encoder", None)
        diff = None if enc is None else float((tower(a) - saved_tower).abs().max())
        results[f"tower_restored_{layout}"] = gather_first(diff)
        ps.destroy_model_parallel()
    finish(rank, results, out)


if __name__ == "__main__":
    main()
