"""The batch-invariant engine (``trainer.deterministic``): a request's tokens and logprobs are the
same bits alone, inside 63 other requests, in either arrival order, whatever the prefill chunking and
the thread count; and the linear layer under it keeps every row's bits whatever the batch."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from agent_r1.engines.embedded import slot_model
from agent_r1.engines.embedded.engine import Engine
from agent_r1.engines.embedded.slot_model import Linear


@pytest.mark.parametrize("packed", [True, False], ids=["onednn", "row-by-row"])
def test_an_invariant_linear_gives_each_row_the_same_bits_in_any_batch(packed, monkeypatch):
    if packed and not slot_model._onednn(torch.float32):
        pytest.skip("no oneDNN here: the row-by-row path is the one in use")
    if not packed:
        monkeypatch.setattr(slot_model, "_onednn", lambda dtype: False)
    g = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    try:
        for n, k in ((192, 64), (800, 64), (1024, 256)):  # a tiny model's sizes and a larger one
            w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
            x = torch.randn(64, k, generator=g)
            lin = Linear(w, b, invariant=True)
            assert (lin.packed is not None) == packed and lin.rowwise == (not packed)
            torch.set_num_threads(max(2, threads))
            full = lin(x)
            ref = torch.nn.functional.linear(x.double(), w.double(), b.double())  # outputs of size ~16
            torch.testing.assert_close(full.double(), ref, rtol=0, atol=1e-4)
            torch.set_num_threads(1)
            for rows in (slice(0, 1), slice(0, 7), slice(5, 6), slice(30, 64)):
                assert torch.equal(lin(x[rows]), full[rows]), (n, k, rows)
    finally:
        torch.set_num_threads(threads)


PROMPTS = 64


@pytest.fixture(scope="module")
def prompts(tokenizer):
    rng = random.Random(0)
    out = []
    for i in range(PROMPTS):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        out.append(tokenizer.encode(f"question {i}: what is {a} plus {b}? " * (1 + i % 5)))
    return out


def _sampling(i: int, n: int = 1) -> dict:
    return {"temperature": 1.0, "max_new_tokens": 16, "sampling_seed": 1000 + i, "ignore_eos": True, "n": n}


def _together(engine: Engine, prompts: list[list[int]], order: list[int]) -> dict[int, list]:
    """Every prompt in flight at once, submitted in ``order``; the first is a group of 4 samples
    sharing its prompt (cascade attention would attend it once for all four)."""
    out: dict[int, list] = {}
    started = threading.Barrier(len(order))

    def one(i: int) -> None:
        started.wait()
        out[i] = engine.generate_sync(prompts[i], _sampling(i, 4 if i == 0 else 1), return_logprob=True)

    threads = [threading.Thread(target=one, args=(i,)) for i in order]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_a_request_gives_the_same_bits_alone_and_inside_63_others(tiny_model_dir, prompts):
    alone_engine = Engine(tiny_model_dir, max_running=64, max_len=512, batch_invariant=True, threads=1)
    alone_engine.start()
    try:
        alone = [
            alone_engine.generate_sync(prompts[i], _sampling(i, 4 if i == 0 else 1), return_logprob=True)
            for i in (0, 1, 63)
        ]
    finally:
        alone_engine.stop()
    # a small prefill chunk: in a full batch a prompt is prefilled in other pieces than alone
    engine = Engine(
        tiny_model_dir, max_running=64, max_len=512, prefill_chunk=48, batch_invariant=True, threads=2
    )
    engine.start()
    try:
        for order in (list(range(PROMPTS)), list(range(PROMPTS))[::-1]):
            together = _together(engine, prompts, order)
            for i, ref in zip((0, 1, 63), alone, strict=True):
                got = together[i]
                assert len(got) == len(ref)
                for s, (g, r) in enumerate(zip(got, ref, strict=True)):
                    assert g.out_ids == r.out_ids, (i, s, order[0])
                    assert g.out_logprobs == r.out_logprobs, (i, s, order[0])  # the same floats
        assert engine.stats["shared_prefix_steps"] == 0  # no cascade attention
        assert engine.stats["prefill_tokens"] > 0 and engine.governor is None
    finally:
        engine.stop()
