"""A warm-up that lets the replica serve early (computed/model/warmup.py `ready`): once one prompt's
forwards are compiled, any group of prompts runs as forwards of one prompt, compiling nothing and
giving the logits a whole group's forward gives; after the rest is compiled, groups run whole."""
from __future__ import annotations

import numpy as np
import pytest

from computed.model.loader import load_model
from computed.model.runner import Runner
from computed.residency.pool import MemoryPool, PoolSpec
from statesvc.tools.example import ExampleAssets
from testkit.jaxcount import counting_compiles

PROMPTS = [[3, 9, 27, 81 % 256, 5], [1, 2, 3], [200, 100, 50, 25, 12, 6, 3], [42]]


@pytest.mark.slow  # a whole warm-up of an 8-row runner with chunks and the store: out of `make test-quick`
def test_ready_comes_before_the_forwards_of_several_prompts(example: ExampleAssets) -> None:
    config, params = load_model(example.model_dir)
    pool = MemoryPool(PoolSpec(num_layers=config.num_layers, module_dims=config.module_dims, slots=2,
                               max_rank=8, dtype="float32"))
    runner = Runner(config, params, max_batch=8, max_len=32, extend=True, piece=16)
    rows, slots = list(range(len(PROMPTS))), [-1] * len(PROMPTS)
    early: dict[str, object] = {}

    def ready() -> None:  # on the warm-up's thread, as the daemon's serving loop would see it
        assert runner.compiled is not None
        early["compiled"] = runner.compiled
        with counting_compiles() as compiles:
            early["logits"], cache = runner.prefill(pool.arrays, runner.new_cache(), PROMPTS, rows, slots)
            # two running rows: a step of all 8 rows (the step of 2 is not compiled yet)
            active = np.zeros(8, np.bool_)
            active[:2] = True
            zeros = np.zeros(8, np.int32)
            early["step"], cache = runner.decode(pool.arrays, cache, zeros + 7, zeros + 5, zeros - 1, active)
            # a one-block prefix hit: copied as the most blocks (the copy of one is not compiled yet)
            runner.load_blocks(cache, store, 0, [3])
        early["compiles"] = len(compiles)

    store = runner.new_blocks(8)
    with counting_compiles() as all_compiles:
        runner.warmup(pool.shapes(), runner.new_cache(), store=store, ready=ready)
    compiled = early["compiled"]
    assert isinstance(compiled, frozenset)
    # a decode step of every row, one prompt at every length of both kinds, nothing of several prompts
    forwards = {(k, n, p) for k, n, p in compiled if k in ("prefill", "extend")}
    assert {(k, p) for k, n, p in forwards} == {(k, p) for k in ("prefill", "extend") for _, p in runner.prefill_shapes}
    assert {n for _, n, _ in forwards} == {1}
    assert ("decode", runner.max_batch, 0) in compiled
    assert {("blocks", runner.block_counts[-1], 0)} == {c for c in compiled if c[0] == "blocks"}
    assert early["compiles"] == 0
    assert runner.compiled is None  # every shape compiled: groups run whole again
    assert len(all_compiles) >= len(runner.prefill_shapes) * 2 + len(runner.decode_rows)

    assert ("decode", 2, 0) not in compiled and 2 in runner.decode_rows
    with counting_compiles() as later:
        whole, cache = runner.prefill(pool.arrays, runner.new_cache(), PROMPTS, rows, slots)
        active = np.zeros(8, np.bool_)
        active[:2] = True
        zeros = np.zeros(8, np.int32)
        step, _ = runner.decode(pool.arrays, cache, zeros + 7, zeros + 5, zeros - 1, active)
    assert len(later) == 0
    np.testing.assert_allclose(early["logits"], whole, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(early["step"][:2], step[:2], rtol=1e-4, atol=1e-4)  # float32 rounding: 8 rows vs 2
