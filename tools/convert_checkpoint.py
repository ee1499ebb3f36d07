#!/usr/bin/env python
"""HF <-> Megatron-Core distributed checkpoints (torch_dist), through megatron_bridge.

    # HF folder -> Megatron checkpoint (any layout: run under torchrun with tp*pp processes)
    python tools/convert_checkpoint.py hf-to-megatron --hf artifacts/tiny-qwen3 --out ckpt/
    torchrun --nproc-per-node 2 tools/convert_checkpoint.py hf-to-megatron --hf DIR --out ckpt/ --tp 2
    # Megatron checkpoint (any layout) -> HF folder (config and tokenizer copied from --hf)
    python tools/convert_checkpoint.py megatron-to-hf --ckpt ckpt/ --hf artifacts/tiny-qwen3 --out hf_out/

SmolLM2's GGUF -> HF is ``tools/convert_gguf.py``.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist


def _init(tp: int, pp: int) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 1000))
    if not dist.is_initialized():
        dist.init_process_group(
            "gloo" if not torch.cuda.is_available() else "nccl",
            rank=int(os.environ.get("RANK", 0)),
            world_size=int(os.environ.get("WORLD_SIZE", 1)),
        )
    import megatron.core  # noqa: F401
    from megatron.core import parallel_state as ps

    from agent_r1.learner.backend.cpu_compat import apply

    apply()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)


def hf_to_megatron(hf: Path, out: Path, tp: int = 1, pp: int = 1) -> None:
    from agent_r1.learner.actor import Actor
    from agent_r1.learner.optim import OptimConfig
    from megatron_bridge import BridgeConfig

    _init(tp, pp)
    Actor(hf, BridgeConfig(tp=tp, pp=pp), OptimConfig(), trainable=False).save(out, with_optimizer=False)


def megatron_to_hf(ckpt: Path, hf: Path, out: Path, dtype: str | None = None) -> None:
    """Loads the checkpoint (any TP/PP layout: resharded on load) into a single-process (TP1, PP1)
    model and writes HF safetensors, in ``dtype`` when given (config.json says so too)."""
    import json

    from safetensors.torch import save_file

    from agent_r1.learner.actor import Actor
    from agent_r1.learner.optim import OptimConfig
    from megatron_bridge import BridgeConfig

    _init(1, 1)
    actor = Actor(hf, BridgeConfig(), OptimConfig(), trainable=False)
    actor.load(ckpt, with_optimizer=False)
    cast = getattr(torch, dtype) if dtype else None
    tensors = {
        n: (t.to(cast) if cast is not None and t.is_floating_point() else t).contiguous()
        for n, t in actor.export_hf()
    }
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in hf.iterdir():  # config, tokenizer, chat template, generation config
        if f.is_file() and not f.name.endswith(".safetensors") and not f.name.endswith(".index.json"):
            shutil.copy2(f, out / f.name)
    if dtype:
        cfg = json.loads((out / "config.json").read_text())
        cfg["torch_dtype"] = cfg["dtype"] = dtype
        (out / "config.json").write_text(json.dumps(cfg, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("hf-to-megatron")
    a.add_argument("--hf", type=Path, required=True)
    a.add_argument("--out", type=Path, required=True)
    a.add_argument("--tp", type=int, default=1)
    a.add_argument("--pp", type=int, default=1)
    b = sub.add_parser("megatron-to-hf")
    b.add_argument("--ckpt", type=Path, required=True)
    b.add_argument("--hf", type=Path, required=True, help="HF folder giving the config and tokenizer")
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.cmd == "hf-to-megatron":
        hf_to_megatron(args.hf, args.out, args.tp, args.pp)
    else:
        megatron_to_hf(args.ckpt, args.hf, args.out, args.dtype)
    print(f"wrote {args.out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
