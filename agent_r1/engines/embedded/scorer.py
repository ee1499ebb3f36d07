"""The engine's logprobs of given tokens, outside a server: the learner's values in deterministic
mode (``trainer.deterministic``: true on-policy).

The learner's Megatron forward and this engine compute the same function with float32 sums in
different orders (a whole sequence at once through PyTorch's kernels; here one row at a time through
oneDNN and the native kernels), so an action token's two logprobs differ in the last bits (~1e-6)
and an on-policy importance ratio is ~1, not 1. ``Scorer`` is the batch-invariant engine's forward
without the server: the HF model the engine serves, in its dtype, receiving weights as a push
would; a ``SlotModel(batch_invariant=True)``, whose every row has the bits it has in any batch of
the engine; and the sampler's logprob arithmetic (``sample.cpp``, the same compiled functions). The
learner takes its logprobs' values from it and their gradients from its own forward
(``learner.logprobs.aligned``).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from agent_r1 import native
from agent_r1.engines.embedded.engine import checkpoint_tensors
from agent_r1.engines.embedded.slot_model import SlotModel
from agent_r1.vision.qwen2_vl import is_vision_config


class Scorer:
    """Logprobs the embedded engine (``Engine(batch_invariant=True)``, the native kernels on) gives
    tokens of sequences under the weights last ``load``-ed."""

    SLOTS = 16  # sequences prefilled together (a KV cache of that many rows)

    def __init__(self, model_dir: str | Path, dtype: str, temperature: float):
        from transformers import AutoConfig, AutoModelForCausalLM

        if is_vision_config(AutoConfig.from_pretrained(model_dir)):
            raise ValueError("the engine's logprobs outside a server cover text models only")
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
        self.params = checkpoint_tensors(self.model)
        self.temperature = float(temperature) or 1.0  # greedy rows report log_softmax(logits): T = 1
        sig = "p i64 i32 i32 f32 p p"
        self.kernel = native.function("sample", "agent_r1_token_logprob", self.model.dtype, sig)
        if self.kernel is None:
            raise RuntimeError(
                "the engine's logprobs need its native kernels, which are not built here (a C++ "
                "compiler is needed; AGENT_R1_NATIVE=0 turns them off)"
            )
        self.slots: SlotModel | None = None  # sized to the longest sequence seen
        self.version: object = None  # what the weights were last loaded as (None: stale)

    def load(self, tensors: Iterable[tuple[str, torch.Tensor]], version: object) -> None:
        """HF-named tensors into the model, as the engine's ``update_weights`` copies a push."""
        with torch.no_grad():
            for name, t in tensors:
                self.params[name].copy_(t.to(self.params[name].dtype))
        if self.slots is not None:
            self.slots.refresh()  # its fused, prepacked copies
        self.version = version

    def _slot_model(self, longest: int) -> SlotModel:
        if self.slots is None or self.slots.max_len < longest:
            size = max(256, 1 << (longest - 1).bit_length())
            self.slots = SlotModel(self.model, self.SLOTS, size, batch_invariant=True)
        return self.slots

    @torch.inference_mode()
    def logprobs(
        self, tokens: torch.Tensor, bounds: list[tuple[int, int]], labels: torch.Tensor
    ) -> torch.Tensor:
        """(len(labels),) float32: the logprob of ``tokens[l]`` after ``tokens[a:l]`` for each
        label row ``l`` of a stream of sequences ``tokens[a:e]`` (``bounds``), each prefilled
        from position 0 as the engine prefills a prompt. A label is never a sequence's first row."""
        tokens, labels = tokens.cpu(), labels.cpu()
        sm = self._slot_model(max(e - a for a, e in bounds))
        out = torch.full((labels.numel(),), float("nan"))
        for first in range(0, len(bounds), self.SLOTS):
            seqs = bounds[first : first + self.SLOTS]
            start, end = seqs[0][0], seqs[-1][1]
            sel = (labels >= start) & (labels < end)
            if not bool(sel.any()):
                continue
            items = [(j, tokens[a:e].tolist(), 0) for j, (a, e) in enumerate(seqs)]
            logits = sm.prefill_many(items, out_rows=labels[sel] - 1 - start)
            lp = torch.empty(logits.shape[0], dtype=torch.float32)
            target = tokens[labels[sel]].contiguous()
            native.call(self.kernel, logits, logits.stride(0), *logits.shape, self.temperature, target, lp)
            out[sel] = lp
        return out
