"""One rank of the Megatron bridge checks (spawned by tests/learner/test_megatron_bridge.py).

argv: rank world port model_dirs(comma) layouts(e.g. 1x1,2x1,1x2,2x2) out_json
For every model and layout: build the GPTModel stage, load the HF weights, run a forward through
Megatron's pipeline schedule, compare logits with the HF model (float64 reference computed here),
and export the weights back to HF names (compared bit for bit with the originals).
"""

import os

import torch
import torch.distributed as dist
from megatron_rank import finish, forward_only, init_rank, rank_argv


def main() -> None:
    rank, world, port, models, layouts, out = rank_argv()
    models, layouts = models.split(","), layouts.split(",")
    torch.set_num_threads(1)  # for the HF references, before the process group exists
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[3, 17, 5, 9, 22, 40, 7, 1, 13, 2], [8, 8, 30, 4, 11, 6, 19, 27, 0, 5]])
    # HF references first: after cpu_compat.apply() transformers' rotary inv_freq buffers load
    # uninitialised (seen with transformers 5.24; cause not isolated), so references come before it
    ref_logits = {}
    for path in models:
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
        with torch.no_grad():
            ref_logits[path] = ref(input_ids=ids).logits
    init_rank(rank, world, port)
    import megatron.core  # noqa: F401
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from agent_r1.learner.backend.cpu_compat import apply
    from megatron_bridge import BridgeConfig, build_gpt_model, export_hf_weights, load_hf_weights

    apply()
    results = []
    for path in models:
        hf_cfg = AutoConfig.from_pretrained(path)
        hf_state = load_file(os.path.join(path, "model.safetensors"))
        for layout in layouts:
            tp, pp = map(int, layout.split("x"))
            ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
            model_parallel_cuda_manual_seed(0)
            model = build_gpt_model(hf_cfg, BridgeConfig(tp=tp, pp=pp))
            load_hf_weights(model, hf_state, hf_cfg)
            got = {}

            def step(data_iterator, model, got=got):
                out = model(ids, torch.arange(ids.shape[1]).expand_as(ids), None)

                def loss(output):
                    got["logits"] = gather_from_tensor_model_parallel_region(output)
                    return output.sum() * 0.0, {}

                return out, loss

            forward_only(model, step, ids.shape[1], ids.shape[0])
            diff = None
            if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0:
                megatron_logits = (
                    got["logits"].transpose(0, 1) if got["logits"].shape[0] != ids.shape[0] else got["logits"]
                )
                diff = float(
                    (megatron_logits[..., : hf_cfg.vocab_size].double() - ref_logits[path]).abs().max()
                )
            exported = dict(export_hf_weights(model, hf_cfg))
            same = all(torch.equal(t, hf_state[n]) for n, t in exported.items())
            names = sorted(exported)
            gathered = [None] * world
            dist.all_gather_object(gathered, {"rank": rank, "diff": diff, "same": same, "names": names})
            if rank == 0:
                all_names = set().union(*(g["names"] for g in gathered))
                expected = set(hf_state) - ({"lm_head.weight"} if hf_cfg.tie_word_embeddings else set())
                results.append(
                    {
                        "model": os.path.basename(path),
                        "layout": layout,
                        "max_logit_diff": max(g["diff"] for g in gathered if g["diff"] is not None),
                        "export_bit_identical": all(g["same"] for g in gathered),
                        "export_complete": all_names == expected,
                        "missing": sorted(expected - all_names)[:5],
                    }
                )
            ps.destroy_model_parallel()
    finish(rank, results, out)


if __name__ == "__main__":
    main()
