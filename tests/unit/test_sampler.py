"""The engine's top-p sampler (computed/serving/engine.py `sample`) against the sort of every token
it replaces: the same token for the same logits, temperature, top_p and seed, including nuclei
larger than its first candidate set and ties at the candidates' edge."""
from __future__ import annotations

import numpy as np
import pytest

from computed.serving.engine import NUCLEUS_CANDIDATES, sample


def sorted_nucleus(logits: np.ndarray, temperature: float, top_p: float, rng: np.random.Generator) -> int:
    """The full sort: every token ordered by descending probability (stable), the smallest prefix
    reaching top_p, drawn from renormalised."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.cumsum(p[order]) - p[order] < top_p
    kept = order[keep]
    q = p[kept] / p[kept].sum()
    return int(kept[rng.choice(len(kept), p=q)])


@pytest.mark.parametrize("vocab", [64, 4096, 151936])
@pytest.mark.parametrize("scale", [0.3, 2.0, 8.0])  # flat (large nuclei) to peaked (a few tokens)
def test_top_p_draws_equal_the_full_sort(vocab: int, scale: float) -> None:
    gen = np.random.default_rng(vocab + int(scale * 10))
    for trial in range(6):
        logits = (gen.standard_normal(vocab) * scale).astype(np.float32)
        for temperature, top_p in ((1.0, 0.9), (0.7, 0.5), (1.3, 0.99), (0.5, 0.05)):
            got = sample(logits, temperature, top_p, np.random.default_rng(trial))
            want = sorted_nucleus(logits, temperature, top_p, np.random.default_rng(trial))
            assert got == want, (vocab, scale, trial, temperature, top_p)


def test_ties_at_the_candidates_edge_keep_id_order() -> None:
    # many tokens share the k-th largest probability: all of them are candidates, in id order
    logits = np.zeros(5000, np.float32)
    logits[::7] = 1.0  # 715 tied leaders, more than the first candidate set
    assert (logits == 1.0).sum() > NUCLEUS_CANDIDATES
    for seed in range(8):
        for top_p in (0.1, 0.6, 0.95):
            assert sample(logits, 1.0, top_p, np.random.default_rng(seed)) == \
                sorted_nucleus(logits, 1.0, top_p, np.random.default_rng(seed))


def test_top_p_one_draws_from_every_token_and_greedy_is_the_argmax() -> None:
    logits = np.array([0.0, 3.0, 1.0, 2.0], np.float32)
    assert sample(logits, 0.0, 0.5, np.random.default_rng(0)) == 1
    draws = [sample(logits, 1.0, 1.0, np.random.default_rng(s)) for s in range(2000)]
    p = np.exp(logits - logits.max())
    p /= p.sum()
    counts = np.bincount(draws, minlength=4) / len(draws)
    assert set(draws) == {0, 1, 2, 3}
    assert np.allclose(counts, p, atol=0.04), (counts, p)
