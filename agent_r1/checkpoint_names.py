"""A transformers model's tensors under the names its checkpoint files use.

transformers >= 5 keeps a mixture-of-experts layer's experts stacked (``mlp.experts.gate_up_proj``
(E, 2 * inter, hidden), ``mlp.experts.down_proj`` (E, hidden, inter)) and converts the public
checkpoints' per-expert tensors (``mlp.experts.{e}.gate_proj.weight``, ``up_proj``, ``down_proj``)
when it loads them. A weight push and the bridge speak the checkpoint's names.
"""

from __future__ import annotations

import torch


def unstack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with every stacked experts pair replaced by one view per expert and
    projection, under its checkpoint name (writing into a view writes the stacked tensor)."""
    out = dict(tensors)
    for name in [n for n in tensors if n.endswith(".experts.gate_up_proj")]:
        prefix = name[: -len("gate_up_proj")]
        gate_up, down = out.pop(name), out.pop(prefix + "down_proj")
        inter = gate_up.shape[1] // 2
        for e in range(gate_up.shape[0]):
            out[f"{prefix}{e}.gate_proj.weight"] = gate_up[e, :inter]
            out[f"{prefix}{e}.up_proj.weight"] = gate_up[e, inter:]
            out[f"{prefix}{e}.down_proj.weight"] = down[e]
    return out
