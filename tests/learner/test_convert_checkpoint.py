import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

TOOL = Path(__file__).parents[2] / "tools" / "convert_checkpoint.py"


def test_hf_megatron_hf_round_trip_is_bit_identical(tiny_model_dir, tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "hf"
    for args in (
        ["hf-to-megatron", "--hf", str(tiny_model_dir), "--out", str(ckpt)],
        ["megatron-to-hf", "--ckpt", str(ckpt), "--hf", str(tiny_model_dir), "--out", str(out)],
    ):
        res = subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
    assert (ckpt / "agent_r1_state.json").exists()
    a, b = load_file(str(tiny_model_dir / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(b) == set(a) - {"lm_head.weight"}  # tied embeddings are saved once
    assert all(torch.equal(a[k], b[k]) for k in b)
    assert (out / "tokenizer.json").exists() and (out / "config.json").exists()
