#!/usr/bin/env python
"""Build a tiny random HF model + BPE tokenizer trained on a recipe's text (CPU tests, quickstart).

python tools/make_tiny_model.py --recipe arithmetic_tool --arch qwen3 --out artifacts/tiny-qwen3
"""

from __future__ import annotations

import argparse
from pathlib import Path

from agent_r1.launch.launcher import build_model
from agent_r1.models.tiny import ARCHS
from agent_r1.train.config import TinyModelConfig
from recipes import RECIPES


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--recipe", default="arithmetic_tool", choices=RECIPES, help="whose text trains the tokenizer"
    )
    ap.add_argument("--arch", default="qwen3", choices=ARCHS)
    ap.add_argument("--out", required=True, help="output folder (an HF model folder)")
    ap.add_argument("--vocab-size", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--chat-format",
        default="chatml",
        choices=["chatml", "llama3", "harmony"],
        help="chat template and tool calls",
    )
    ap.add_argument(
        "--split-digits", action="store_true", help="one token per digit (as Qwen2 tokenizes numbers)"
    )
    a = ap.parse_args()
    settings = {k: v for k, v in vars(a).items() if k != "out"}  # the flags are TinyModelConfig's fields
    out = build_model(TinyModelConfig(at=a.out, **settings), Path(a.out))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
