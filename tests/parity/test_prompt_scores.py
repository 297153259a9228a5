"""Prompt logprobs from prefill's hidden states (computed/model/scores.py): whole prompts and
16-token chunks give every position's logprob and top-k as the whole-sequence forward's
log_softmax does, and after the warm-up nothing compiles for them."""
from __future__ import annotations

import jax
import numpy as np

from computed.model.loader import load_model
from computed.model.runner import Runner, forward_full
from computed.residency.pool import MemoryPool, PoolSpec
from computed.serving.logprobs import scored
from statesvc.tools.example import ExampleAssets
from testkit.jaxcount import counting_compiles


def test_prefill_scores_every_position_whole_or_in_chunks_with_no_compile(example: ExampleAssets) -> None:
    config, params = load_model(example.model_dir)
    pool = MemoryPool(PoolSpec(num_layers=config.num_layers, module_dims=config.module_dims, slots=2,
                               max_rank=8, dtype="float32"))
    runner = Runner(config, params, max_batch=4, max_len=64, extend=True, piece=16)
    cache = runner.new_cache()
    runner.warmup(pool.arrays, cache)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (40, 9, 14)]
    k = 5
    with counting_compiles() as compiles:
        # prompt 0 in 16-token pieces (extend), the others whole, in one call per piece
        hidden: dict[int, list[np.ndarray]] = {0: [], 1: [], 2: []}
        last = None
        for end in (16, 32, 40):
            got: dict[int, np.ndarray] = {0: np.zeros(0)}
            if end == 16:
                got.update({1: np.zeros(0), 2: np.zeros(0)})
            part = [prompts[0][:end]] + ([prompts[1], prompts[2]] if end == 16 else [])
            rows, slots = [0, 1, 2][:len(part)], [-1] * len(part)
            starts = [(end - 1) // 16 * 16] + [0] * (len(part) - 1)
            logits, cache = runner.prefill(pool.arrays, cache, part, rows, slots,
                                           starts=starts if any(starts) else None, hidden=got)
            for i, h in got.items():
                hidden[i].append(h)
            last = logits[0]
        scores = {i: runner.score(np.concatenate(hidden[i])[:len(p) - 1], p[1:], k) for i, p in enumerate(prompts)}
    assert not compiles, f"{len(compiles)} compiles while serving"
    for i, p in enumerate(prompts):
        full = np.asarray(forward_full(params, None, np.asarray([p], np.int32), np.asarray([-1], np.int32)))[0]
        lsm = np.asarray(jax.nn.log_softmax(full, axis=-1))
        assert len(scores[i]) == len(p) - 1
        for t, s in enumerate(scores[i], 1):
            assert abs(s["logprob"] - lsm[t - 1, p[t]]) < 1e-4
            assert np.allclose(s["top_logprobs"], np.sort(lsm[t - 1])[::-1][:k], atol=1e-4)
            assert lsm[t - 1, s["top_ids"][0]] == lsm[t - 1].max()
    # the host side scores the last position's logits the same way
    assert last is not None
    p = prompts[0]
    full = np.asarray(forward_full(params, None, np.asarray([p], np.int32), np.asarray([-1], np.int32)))[0]
    host = scored(last, int(np.argmax(last)), k)
    assert abs(host["logprob"] - np.asarray(jax.nn.log_softmax(full[-1])).max()) < 1e-4
    assert np.allclose(host["top_logprobs"], np.sort(np.asarray(jax.nn.log_softmax(full[-1])))[::-1][:k], atol=1e-4)
