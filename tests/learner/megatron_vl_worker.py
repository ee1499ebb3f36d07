"""One rank of the vision-language learner checks (Qwen2-VL family): packed logprobs with images
through Megatron's language model + the vision tower at TP1 / TP2 / PP2 equal transformers' own
``Qwen2VLForConditionalGeneration`` (float64, each sequence on its own); weight export round trip."""

import torch
import torch.distributed as dist
from megatron_rank import (
    finish,
    forward_logprobs,
    hf_model_at,
    init_rank,
    layouts,
    max_diff_over_ranks,
    rank_argv,
)
from vision import image_bytes


def sequences(model_dir, vocab):
    """Three sequences: two images + text, one image (tall), text only; each + 9 sampled tokens."""
    from agent_r1.agent.chat import ChatCodec

    codec = ChatCodec.load(model_dir)
    g = torch.Generator().manual_seed(0)
    a, b, c = image_bytes(90, 60, seed=1), image_bytes(300, 40, seed=2), image_bytes(61, 117, seed=3)
    chats = [
        [{"role": "user", "content": [{"type": "image", "image": a}, {"type": "text", "text": "Sum of"},
                                      {"type": "image", "image": b}, {"type": "text", "text": "?"}]}],
        [{"role": "user", "content": [{"type": "text", "text": "Read:"}, {"type": "image", "image": c}]}],
        [{"role": "user", "content": "Ava has 3 apples."}],
    ]  # fmt: skip
    out = []
    for msgs in chats:
        ids, images = codec.encode_chat_images(msgs)
        action = torch.randint(3, vocab, (9,), generator=g).tolist()
        out.append((ids, action, images))
    return codec, out


def main() -> None:
    rank, world, port, model_dir, out = rank_argv()
    torch.set_num_threads(1)
    from transformers import AutoConfig, AutoModelForImageTextToText

    from agent_r1.vision.qwen2_vl import mrope_positions, mrope_sections

    hf = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float64).eval()
    cfg = AutoConfig.from_pretrained(model_dir)
    from megatron_bridge import language_config

    lm = language_config(cfg)
    codec, seqs = sequences(model_dir, lm.vocab_size)
    # reference: each sequence alone through the HF model, its own processor's pixels
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    proc = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
    ref = []
    with torch.no_grad():
        for ids, act, images in seqs:
            full = torch.tensor([ids + act])
            kw = {}
            if images:
                px = proc(images=[im.to_pil() for im in images], return_tensors="pt")
                kw = dict(pixel_values=px["pixel_values"].double(), image_grid_thw=px["image_grid_thw"],
                          mm_token_type_ids=(full == cfg.image_token_id).int())  # fmt: skip
            logp = torch.log_softmax(hf(input_ids=full, **kw).logits[0].double(), -1)
            ref.append(logp[len(ids) - 1 : -1].gather(1, full[0, len(ids) :, None])[:, 0])
    ref = torch.cat(ref)

    # the packed micro-batch: sequences back to back, 3-row positions, image pads and images in order
    from agent_r1.learner.packing import Packed

    spec = codec.vision
    tokens, pos, label_pos, images, bounds = [], [], [], [], []
    for ids, act, ims in seqs:
        start = len(tokens)
        seq = ids + act
        p, delta = mrope_positions(ids, cfg.image_token_id, [spec.grid(im) for im in ims], spec.merge_size)
        tail = torch.arange(len(ids), len(seq)) + delta
        pos.append(torch.cat([torch.from_numpy(p), tail.expand(3, -1)], 1))
        tokens += seq
        label_pos += list(range(start + len(ids), start + len(seq)))
        images += ims
        bounds.append((start, len(tokens)))
    t = torch.tensor(tokens)
    a = len(label_pos)
    packed = Packed(
        tokens=t, positions=torch.cat(pos, 1), seq_id=torch.cat([torch.full((e - s,), i) for i, (s, e) in enumerate(bounds)]),
        cu_seqlens=torch.tensor([0] + [e for _, e in bounds]), label_pos=torch.tensor(label_pos),
        label_step=torch.zeros(a, dtype=torch.long), label_mask=torch.ones(a, dtype=torch.bool), num_steps=1,
        step_value_pos=torch.tensor([0]), act_index=torch.arange(a), step_index=torch.tensor([0]), bounds=bounds,
        trajectories=torch.arange(1).numpy(), images=images, image_pos=torch.nonzero(t == cfg.image_token_id)[:, 0],
    )  # fmt: skip

    init_rank(rank, world, port)
    import megatron.core  # noqa: F401
    from megatron.core import parallel_state as ps
    from safetensors.torch import load_file

    from agent_r1.learner.backend.cpu_compat import apply
    from agent_r1.learner.forward import install_packed_rotary, packed_forward
    from agent_r1.learner.logprobs import packed_logprobs
    from agent_r1.learner.vision import VisionEncoder
    from megatron_bridge import BridgeConfig, build_gpt_model, export_hf_weights, load_hf_weights

    apply()
    state = load_file(f"{model_dir}/model.safetensors")
    vision = VisionEncoder(cfg, model_dir, state)
    sections = mrope_sections(cfg, lm.hidden_size // lm.num_attention_heads)[
        : lm.hidden_size // lm.num_attention_heads // 2
    ]
    results = {}
    for layout, tp, pp in layouts():
        model = hf_model_at(cfg, state, tp, pp)
        install_packed_rotary(model, sections)
        results[layout] = max_diff_over_ranks(
            forward_logprobs(model, packed, lm.vocab_size, vision), ref, world
        )
        # export: the language model's tensors under their checkpoint names, plus the tower's
        exported = dict(export_hf_weights(model, cfg))
        stage = [None] * world
        dist.all_gather_object(stage, {k: float((v - state[k]).abs().max()) for k, v in exported.items()})
        merged = {k: v for s in stage for k, v in s.items()}
        merged.update({k: float((v - state[k]).abs().max()) for k, v in vision.export_hf()})
        results[f"{layout}_export_names"] = sorted(merged) == sorted(state)
        results[f"{layout}_export_diff"] = max(merged.values())
    # the images matter: the same packed stream with the pads' token embeddings gives other logprobs
    ps.initialize_model_parallel()
    model = build_gpt_model(cfg, BridgeConfig())
    load_hf_weights(model, state, cfg)
    install_packed_rotary(model, sections)
    with torch.no_grad():
        plain = Packed(**{**packed.__dict__, "images": [], "image_pos": None, "cache": {}})
        lp_plain, _ = packed_logprobs(
            packed_forward(model, plain, packed.label_pos - 1),
            packed.tokens[packed.label_pos],
            vocab_size=lm.vocab_size,
        )
    results["without_images_diff"] = float((lp_plain.double() - ref).abs().max())
    try:
        packed_forward(model, packed, packed.label_pos - 1)
        results["no_tower_error"] = ""
    except ValueError as e:
        results["no_tower_error"] = str(e)
    ps.destroy_model_parallel()
    finish(rank, results, out, indent=None)


if __name__ == "__main__":
    main()
