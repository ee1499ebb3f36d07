"""A reference ``generate`` on HuggingFace ``transformers`` (one request at a time, KV cache).

Used by the quickstart until the embedded engine lands, and later as the reference the engine is
checked against. Logprob = log_softmax(logits / T) of the sampled token, before top-k/top-p
truncation (SGLang's meaning); T = 0 is greedy with logprobs of the untempered distribution.
"""

from __future__ import annotations

import asyncio
import inspect
from pathlib import Path

import torch

from agent_r1.engines.embedded.sampling import Sampling, sample_batch
from agent_r1.rollout.protocol import Completion, FinishReason, SamplingParams


class HFGenerator:
    """``GenerateFn`` over a local HF model folder; calls are serialised (one model, one thread)."""

    def __init__(self, model_dir: str | Path, dtype: torch.dtype = torch.float32, policy_version: int = 0):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
        self.max_positions = int(getattr(self.model.config, "max_position_embeddings", 1 << 30))
        self.policy_version = policy_version
        # transformers >= 5.2x renamed past_key_values -> cache (argument and output field)
        self._cache_arg = (
            "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        )
        self._lock = asyncio.Lock()

    async def __call__(
        self, token_ids: list[int], sampling: SamplingParams, images: list | None = None
    ) -> Completion:
        if images:
            raise ValueError("the transformers reference generator serves text; serve images with the engine")
        async with self._lock:
            return await asyncio.to_thread(self.generate_sync, token_ids, sampling)

    @torch.inference_mode()
    def generate_sync(self, token_ids: list[int], s: SamplingParams) -> Completion:
        if not token_ids:
            raise ValueError("input_ids is empty")
        gen = torch.Generator().manual_seed(s.seed) if s.seed is not None else None
        shared = torch.Generator().manual_seed(torch.seed() % (1 << 31))
        params = Sampling(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k)
        budget = min(s.max_new_tokens, self.max_positions - len(token_ids))
        out_ids: list[int] = []
        logprobs: list[float] = []
        reason = FinishReason.LENGTH
        past = None
        inp = torch.tensor([token_ids])
        stop = set(s.stop_token_ids)
        for _ in range(max(budget, 0)):
            res = self.model(input_ids=inp, use_cache=True, **{self._cache_arg: past})
            past = getattr(res, self._cache_arg)
            toks, lps, _ = sample_batch(res.logits[:, -1].float(), [params], [gen], [None], shared)
            tok, lp = toks[0], lps[0]
            out_ids.append(tok)
            logprobs.append(lp)
            if tok in stop:
                reason = FinishReason.STOP
                break
            inp = torch.tensor([[tok]])
        return Completion(out_ids, logprobs, reason, self.policy_version)
