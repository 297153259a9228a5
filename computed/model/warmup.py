"""Ahead-of-time compiles: every prefill, chunk, decode and block copy that serving calls, compiled
into jit's caches before the first request, from shapes alone (computed/model/runner.py
`LlamaRunner.warmup` calls it with the runner's buckets)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from computed.model import kv_blocks
from computed.model.kv_blocks import KVBlocks
from computed.model.kv_cache import KVCache
from computed.model.llama import decode_jit, extend_jit, prefill_jit, rope_tables
from computed.model.params import LlamaParams
from computed.residency.pool import LoraPool


def compile_serving(params: LlamaParams, lora_pool: LoraPool | None, cache: KVCache, *,
                    prefill_shapes: tuple[tuple[int, int], ...], attend_lens: tuple[int, ...],
                    extend_shapes: tuple[tuple[int, int], ...] = (), store: KVBlocks | None = None,
                    block_counts: tuple[int, ...] = (),
                    stop: Callable[[], bool] = lambda: False) -> None:
    """Compile, ahead of time and into jit's caches, every prefill and decode that serving calls:
    one per prefill shape (prompts, prompt length) and per chunk shape (`extend_shapes`), one per
    attention length (only one with the attention kernel) and LoRA window of the backend, and
    the block store's two copies per block count (with a `store`). Only the shapes and dtypes
    of `lora_pool`, `cache` and `store` are used
    (nothing is read or donated), so a replica can warm up while diffs keep writing its pool.
    `stop()` is asked before each compile: a replica that stops while it warms up waits for one
    compile, not all of them, and exits with no compile running (a thread inside XLA when the
    interpreter shuts down aborts the process)."""
    def shapes(tree: Any) -> Any:  # a mesh's layout kept: what a tensor-parallel replica calls with
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding if isinstance(
            getattr(a, "sharding", None), NamedSharding) else None), tree)

    backend = params.backend
    backend.check_cache(cache)
    pool_s, cache_s = shapes(lora_pool), shapes(cache)
    for n, p in prefill_shapes:  # as `prefill_batch` calls it
        if stop():
            return
        per_prompt = np.zeros(n, np.int32)
        prefill_jit.lower(params, pool_s, cache_s, np.zeros((n, p), np.int32), per_prompt, per_prompt,
                          per_prompt).compile()
    for n, p in extend_shapes:  # as `prefill_batch` calls it with starts
        if stop():
            return
        per_prompt = np.zeros(n, np.int32)
        extend_jit.lower(params, pool_s, cache_s, np.zeros((n, p), np.int32), per_prompt, per_prompt,
                         per_prompt, per_prompt).compile()
    if store is not None:
        store_s, row = shapes(store), np.int32(0)
        for m in block_counts:  # as `LlamaRunner.load_blocks` and `save_blocks` call them
            if stop():
                return
            ids = np.zeros(m, np.int32)
            kv_blocks.load_row.lower(cache_s, store_s, row, ids).compile()
            kv_blocks.save_row.lower(store_s, cache_s, row, ids, ids).compile()
    for n in backend.decode_rows(cache.max_batch):  # as `decode` calls it
        zeros = np.zeros(n, np.int32)
        windows = backend.windows(n) if lora_pool is not None else (None,)
        for attend_len in sorted({backend.attend_len(cache, p) for p in attend_lens}):
            for window in windows:
                if stop():
                    return
                decode_jit.lower(params, pool_s, cache_s, zeros, zeros, zeros, np.zeros(n, np.bool_),
                                 rope_tables(zeros, params.config), attend_len=attend_len, window=window,
                                 rows=None if n == cache.max_batch else zeros).compile()
