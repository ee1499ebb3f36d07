"""A request of the embedded engine (its prompt, sampling, slot and output so far) and the prefix
cache of finished requests' KV (looked up by longest common prefix)."""

from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from agent_r1.engines.embedded.sampling import Sampling
from agent_r1.vision.images import Image, pad_runs

log = logging.getLogger("agent_r1.engine")


@dataclass
class Request:
    rid: str
    prompt: list[int]
    sampling: Sampling
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    index: int = 0
    on_update: Callable[[Request, bool], None] | None = None  # (request, finished), scheduler thread
    out_ids: list[int] = field(default_factory=list)
    out_logprobs: list[float] = field(default_factory=list)
    out_top: list[list[tuple[float, int]]] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    state: str = "waiting"  # waiting | prefill | decode | done
    slot: int = -1
    computed: int = 0  # KV positions valid in the slot
    cached_tokens: int = 0
    retractions: int = 0
    finish: dict[str, Any] | None = None
    weight_version: str = "default"
    created: float = field(default_factory=time.time)
    finished_at: float = 0.0
    gen: torch.Generator | None = None  # own generator when seeded, else the engine's shared one
    stops: frozenset[int] = frozenset()  # stop token ids (+ EOS unless ignore_eos)
    # (key, P): KV positions 0..P-1 are the same as those of every running request with this key
    # (the samples of one group); decode attends over that shared prefix once per group
    shared: tuple[int, int] | None = None
    images: list[Image] = field(default_factory=list)  # one per <|image_pad|> run, in order
    image_pad: int = -1  # the model's <|image_pad|> id (image requests)
    rope: torch.Tensor | None = None  # (3, len(prompt)) multimodal rotary positions
    rope_delta: int = 0  # rotary position - cache position for tokens after the prompt
    features: torch.Tensor | None = None  # (pads, hidden): the images' embeddings, pad by pad
    _prompt_arr: np.ndarray | None = None

    @property
    def prompt_arr(self) -> np.ndarray:
        """The prompt as prefix matching sees it: an image pad is its image's key (negative)."""
        if self._prompt_arr is None:
            arr = np.asarray(self.prompt, dtype=np.int64)
            if self.images:
                arr = arr.copy()
                for im, (a, b) in zip(self.images, self.pad_runs(), strict=True):
                    arr[a:b] = -1 - int(im.hash[:15], 16)
            self._prompt_arr = arr
        return self._prompt_arr

    def pad_runs(self) -> list[tuple[int, int]]:
        """(start, end) of each image's pad run in the prompt."""
        return pad_runs(self.prompt, self.image_pad)

    def key_tokens(self, n: int) -> list[int]:
        """The first ``n`` tokens in the keyed form (for the prefix cache)."""
        p = self.prompt_arr.tolist()
        return (p + self.out_ids)[:n]

    def common_prefix(self, toks: np.ndarray, limit: int) -> int:
        """Length of the common prefix of this request's first ``limit`` tokens and ``toks``."""
        p = self.prompt_arr
        n = common_prefix_len(p[:limit], toks)
        if n < min(len(p), limit) or limit <= len(p):
            return n
        return n + common_prefix_len(
            np.asarray(self.out_ids[: limit - len(p)], dtype=np.int64), toks[len(p) :]
        )

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out_ids

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.out_ids)


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0 or a[0] != b[0]:
        return 0
    neq = np.flatnonzero(a[:n] != b[:n])
    return int(neq[0]) if len(neq) else n


class PrefixCache:
    """KV of finished sequences, LRU-bounded by tokens; the longest prefix match is reused."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.entries: OrderedDict[int, tuple[np.ndarray, torch.Tensor, torch.Tensor]] = OrderedDict()
        self.tokens = 0
        self._ids = itertools.count()

    def add(self, tokens: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        n = len(tokens)
        if n == 0 or n > self.max_tokens:
            return
        while self.tokens + n > self.max_tokens and self.entries:
            _, (t, _, _) = self.entries.popitem(last=False)
            self.tokens -= len(t)
        self.entries[next(self._ids)] = (np.asarray(tokens, dtype=np.int64), k, v)
        self.tokens += n

    def best(self, tokens: np.ndarray) -> tuple[int, int]:
        best_key, best_len = -1, 0
        for key, (t, _, _) in self.entries.items():
            n = common_prefix_len(t, tokens)
            if n > best_len:
                best_key, best_len = key, n
        if best_key >= 0:
            self.entries.move_to_end(best_key)
        return best_key, best_len

    def clear(self) -> None:
        self.entries.clear()
        self.tokens = 0
