"""Packed, prefix-merged policy logprobs through Megatron at TP1/TP2/PP2 equal per-step
recomputation with the HF model; the vocab-parallel logprob/entropy backward equals autograd."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("megatron_policy_worker.py")


@pytest.fixture(scope="module")
def policy_results(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("policy") / "results.json"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(r), "2", port, str(tiny_model_dir), str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    return json.loads(out.read_text())


@pytest.mark.parametrize("layout", ["1x1", "2x1", "1x2"])
def test_prefix_merged_packed_logprobs_equal_per_step(policy_results, layout):
    assert policy_results[layout] < 1e-5


def test_vocab_parallel_backward(policy_results):
    assert policy_results["vocab_parallel_value_diff"] < 1e-6
    assert policy_results["vocab_parallel_grad_diff"] < 1e-6
