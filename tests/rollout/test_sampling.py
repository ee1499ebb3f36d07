"""The batched sampler against hand-worked distributions: truncation rules, banned tokens, greedy
rows, tempered untruncated logprobs (float64 reference) and the empirical draw frequencies."""

import math

import numpy as np
import torch

from agent_r1.engines.embedded.sampling import Sampling, sample_batch
from agent_r1.rollout.protocol import logprob_temperature

# one row: probabilities 0.4, 0.3, 0.2, 0.06, 0.04 at T = 1
P = [0.4, 0.3, 0.2, 0.06, 0.04]
LOGITS = torch.log(torch.tensor(P, dtype=torch.float32))


def draw(s: Sampling, n: int = 20000, banned=None, seed: int = 0, want_probs: bool = True):
    logits = LOGITS.repeat(n, 1)
    gen = torch.Generator().manual_seed(seed)
    toks, lps, probs = sample_batch(logits, [s] * n, [None] * n, [banned] * n, gen, want_probs=want_probs)
    return np.bincount(toks, minlength=len(P)) / n, lps, toks, probs


def expect(weights):
    w = np.asarray(weights, dtype=np.float64)
    return w / w.sum()


def test_plain_tempered_and_truncated_frequencies():
    # T = 1: the distribution itself
    freq, lps, toks, probs = draw(Sampling())
    np.testing.assert_allclose(freq, P, atol=0.015)
    np.testing.assert_allclose(lps, np.log(np.asarray(P))[toks], atol=1e-6)
    np.testing.assert_allclose(probs[0].numpy(), P, atol=1e-6)
    # T = 0.5: p^2 renormalised; logprobs are log_softmax(logits / T) in float64
    freq, lps, toks, _ = draw(Sampling(temperature=0.5))
    ref = expect(np.asarray(P) ** 2)
    np.testing.assert_allclose(freq, ref, atol=0.015)
    np.testing.assert_allclose(lps, np.log(ref)[toks], atol=1e-6)
    # top_k = 2: only the two largest, renormalised; logprobs stay untruncated
    freq, lps, toks, _ = draw(Sampling(top_k=2))
    np.testing.assert_allclose(freq, expect([0.4, 0.3, 0, 0, 0]), atol=0.015)
    np.testing.assert_allclose(lps, np.log(np.asarray(P))[toks], atol=1e-6)
    # top_p = 0.75: the smallest set whose mass reaches 0.75 is {0.4, 0.3, 0.2}
    freq, *_ = draw(Sampling(top_p=0.75))
    np.testing.assert_allclose(freq, expect([0.4, 0.3, 0.2, 0, 0]), atol=0.015)
    # min_p = 0.2: keep p >= 0.2 * 0.4 = 0.08
    freq, *_ = draw(Sampling(min_p=0.2))
    np.testing.assert_allclose(freq, expect([0.4, 0.3, 0.2, 0, 0]), atol=0.015)
    # banned tokens (stop ids before min_new_tokens) are never drawn
    freq, *_ = draw(Sampling(), banned=[0, 2])
    np.testing.assert_allclose(freq, expect([0, 0.3, 0, 0.06, 0.04]), atol=0.015)


def test_mixed_rows_greedy_seeded():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    logits[5] = logits[1]  # same logits and seed: same draw
    params = [
        Sampling(temperature=0),
        Sampling(temperature=0.7, sampling_seed=3),
        Sampling(temperature=1.3, top_k=5),
        Sampling(temperature=0),
        Sampling(temperature=1.0, top_p=0.5),
        Sampling(temperature=0.7, sampling_seed=3),
    ]

    def run(shared_seed: int):
        gens = [torch.Generator().manual_seed(3) if p.sampling_seed else None for p in params]
        return sample_batch(logits, params, gens, [None] * 6, torch.Generator().manual_seed(shared_seed))

    toks, lps, probs = run(0)
    assert probs is None  # only computed when asked for
    assert toks[0] == int(logits[0].argmax()) and toks[3] == int(logits[3].argmax())
    assert toks[2] in torch.topk(logits[2], 5).indices.tolist()
    for i, p in enumerate(params):
        t = p.temperature or 1.0
        ref = torch.log_softmax(logits[i].double() / t, -1)[toks[i]].item()
        assert math.isclose(lps[i], ref, abs_tol=1e-5), (i, lps[i], ref)
    # seeded rows draw from their own generators: the same whatever the shared generator does
    again, _, _ = run(99)
    assert again[1] == toks[1] and again[5] == toks[5] and toks[1] == toks[5]


def test_the_learner_tempers_logprobs_as_the_sampler_returns_them():
    """``logprob_temperature`` (what the learner divides its logits by) names the T of the
    sampler's own logprobs: T itself, and 1 for a request that samples greedily (T = 0, or a
    vanishing T that validation turns greedy, as SGLang)."""
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(2))
    for temp in (1.3, 0.7, 1e-5, 9e-6, 0.0):
        s = Sampling.from_dict({"temperature": temp}, 50)
        (tok,), (lp,), _ = sample_batch(logits, [s], [None], [None], torch.Generator().manual_seed(0))
        t = logprob_temperature(temp)
        assert t == (1.0 if temp < 1e-5 else temp)
        assert math.isclose(lp, torch.log_softmax(logits[0].double() / t, -1)[tok].item(), abs_tol=1e-5), temp


def test_the_native_sampler_draws_what_the_torch_path_draws():
    """Untruncated rows (the common case) go through the native kernel: with the same generators
    it picks the tokens of the PyTorch path (which the cases above check against hand-worked
    distributions; a top_k row sends the batch there) with the same logprobs, from float32 and
    from bf16 logits read in place (a vocabulary slice of wider rows), greedy rows included; and
    its own draws follow the distribution."""
    from agent_r1.engines.embedded import sampling

    g = torch.Generator().manual_seed(5)
    wide = torch.randn(40, 300, generator=g) * 3
    temps = [0.0, 1.0, 0.7, 1.3] * 10
    params = [Sampling(temperature=t, sampling_seed=7 if i % 5 == 0 else None) for i, t in enumerate(temps)]
    for dtype in (torch.float32, torch.bfloat16):
        logits = wide.to(dtype)[:, :250]
        assert sampling._kernel(logits) is not None

        def run(extra, logits=logits):
            gens = [torch.Generator().manual_seed(7) if p.sampling_seed else None for p in params + extra]
            rows = torch.cat([logits, logits[:1]]) if extra else logits
            out = sample_batch(
                rows, params + extra, gens, [None] * len(gens), torch.Generator().manual_seed(1)
            )
            return out[0][:40], np.asarray(out[1][:40])

        toks, lps = run([])  # native
        ref_toks, ref_lps = run([Sampling(top_k=3)])  # the PyTorch path: same uniforms for rows 0..39
        assert toks == ref_toks
        np.testing.assert_allclose(lps, ref_lps, atol=1e-5)
        assert all(toks[i] == int(logits[i].float().argmax()) for i in range(0, 40, 4))  # greedy rows
    freq = np.bincount(draw(Sampling(), n=20000, want_probs=False)[2], minlength=len(P)) / 20000
    np.testing.assert_allclose(freq, P, atol=0.015)
