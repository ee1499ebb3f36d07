"""The learner's optimizer helpers: torch's fused Adam kernel gives the per-tensor loop's update."""

import copy

import torch

from agent_r1.learner.optim import torch_optimizers, use_fused_adam


class _Megatronish:  # what use_fused_adam reads of a Megatron optimizer: .optimizer (or a chain)
    def __init__(self, opt):
        self.optimizer = opt


def test_fused_adam_equals_the_per_tensor_loop():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*s)) for s in [(64, 32), (32,), (7, 5, 3)]]
    loop_params = copy.deepcopy(params)
    fused = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))
    loop = torch.optim.AdamW(loop_params, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), foreach=False)
    chained = type("Chained", (), {"chained_optimizers": [_Megatronish(fused)]})()
    assert torch_optimizers(chained) == [fused]
    assert use_fused_adam(chained) == 1 and fused.param_groups[0]["fused"]
    assert use_fused_adam(chained) == 0  # already fused: nothing to switch
    for step in range(5):
        for p, q in zip(params, loop_params, strict=True):
            g = torch.randn_like(p) * (step + 1)
            p.grad, q.grad = g.clone(), g.clone()
        fused.step()
        loop.step()
    for p, q in zip(params, loop_params, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(fused.state[p]["exp_avg_sq"], loop.state[q]["exp_avg_sq"])


def test_other_optimizers_are_left_alone():
    p = torch.nn.Parameter(torch.randn(3))
    sgd = torch.optim.SGD([p], lr=0.1)
    assert use_fused_adam(_Megatronish(sgd)) == 0 and not sgd.param_groups[0].get("fused")
