"""A bf16 learner's gradients go into Megatron-Core's float32 main gradients through the native
add (``agent_r1.learner.backend.main_grad``): the same sums as upstream's ``main_grad.add_``."""

import json
from pathlib import Path

import pytest
import torch
from spawn import spawn_ranks

WORKER = Path(__file__).with_name("megatron_main_grad_worker.py")


def test_the_native_add_equals_pytorchs_bit_for_bit():
    from agent_r1.learner.backend.main_grad import accumulate

    g = torch.Generator().manual_seed(0)
    main = torch.randn(1000, 37, generator=g) * 1e-3
    grad = (torch.randn(1000, 37, generator=g) * 10).bfloat16()
    grad[0, :3] = torch.tensor([float("inf"), float("nan"), -0.0])
    want = main.clone().add_(grad)
    assert accumulate(main, grad)
    torch.testing.assert_close(main, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize(
    "main, grad",
    [
        (torch.zeros(8), torch.zeros(8)),  # a float32 model: upstream's add
        (torch.zeros(8, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.bfloat16)),  # bf16 main grads
        (torch.zeros(8), torch.zeros(4, 4, dtype=torch.bfloat16)[:, :2]),  # not contiguous
        (torch.zeros(8, device="meta"), torch.zeros(8, dtype=torch.bfloat16, device="meta")),  # dry run
    ],
)
def test_elsewhere_it_leaves_the_add_to_the_caller(main, grad):
    from agent_r1.learner.backend.main_grad import accumulate

    before = main.clone()
    assert not accumulate(main, grad)
    if main.device.type != "meta":
        assert torch.equal(main, before)


def test_a_bf16_actor_trains_to_the_same_parameters_as_with_upstreams_add(tiny_model_dir, tmp_path):
    out = tmp_path / "results.json"
    spawn_ranks(WORKER, 1, tiny_model_dir, out)
    r = json.loads(out.read_text())
    assert r["native_adds"] >= 2 * r["params"] and r["embedding_added"], r
    n_norms, u_norms = r["grad_norms"]
    assert n_norms == u_norms and n_norms[0] > 0, r["grad_norms"]
    assert r["unequal"] == [], r["unequal"]
