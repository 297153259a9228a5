"""Ahead-of-time compiles: every prefill, chunk, decode and block copy that serving calls, compiled
into jit's caches before the first request, from shapes alone (computed/model/runner.py
`Runner.warmup` calls it with the runner's buckets)."""
from __future__ import annotations

import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from computed.model import kv_blocks, kv_cache, scores
from computed.model.kv_blocks import KVBlocks
from computed.model.kv_cache import KVCache
from computed.model.decoder import decode_jit, extend_jit, prefill_jit, rope_tables
from computed.model.params import DecoderParams
from computed.residency.pool import LoraPool

COMPILE_THREADS = min(2, os.cpu_count() or 1)  # compiles at once (`compile_serving`)


def compile_serving(params: DecoderParams, lora_pool: LoraPool | None, cache: KVCache, *,
                    prefill_shapes: tuple[tuple[int, int], ...], attend_lens: tuple[int, ...],
                    extend_shapes: tuple[tuple[int, int], ...] = (), store: KVBlocks | None = None,
                    block_counts: tuple[int, ...] = (),
                    stop: Callable[[], bool] = lambda: False,
                    ready: Callable[[], None] | None = None,
                    compiled: Callable[[str, int, int], None] = lambda kind, n, p: None,
                    threads: int = COMPILE_THREADS) -> None:
    """Compile, ahead of time and into jit's caches, every prefill and decode that serving calls:
    one per prefill shape (prompts, prompt length) and per chunk shape (`extend_shapes`), one per
    attention length (only one with the attention kernel) and LoRA window of the backend, and
    the block store's two copies per block count (with a `store`), the copy of a row into
    another that forks a request's choices (`kv_cache.copy_row`, one shape), and prompt
    logprobs' one scoring function (computed/model/scores.py). Only the shapes and dtypes
    of `lora_pool`, `cache` and `store` are used
    (nothing is read or donated), so a replica can warm up while diffs keep writing its pool.
    `stop()` is asked before each compile: a replica that stops while it warms up waits for one
    compile, not all of them, and exits with no compile running (a thread inside XLA when the
    interpreter shuts down aborts the process).

    With `ready`, what a replica needs to serve every request comes first: a decode step of every
    row, the block copies, and prefill and chunks of one prompt at every length; then `ready()`
    is called (the
    replica serves from then on; `essential`), and the forwards of several prompts at once and
    decode steps of fewer rows follow, each reported by `compiled("prefill" | "extend" | "decode",
    n, P)` as it is done (every one is): until then the runner runs what is compiled
    (computed/model/runner.py). A replica at Qwen2.5-0.5B's geometry serves after 11 of its
    34 large compiles."""
    def shapes(tree: Any) -> Any:  # a mesh's layout kept: what a tensor-parallel replica calls with
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding if isinstance(
            getattr(a, "sharding", None), NamedSharding) else None), tree)

    backend = params.backend
    backend.check_cache(cache)
    pool_s, cache_s = shapes(lora_pool), shapes(cache)
    # (kind, n, P, compile): each forward serving calls, as the runner calls it
    jobs: list[tuple[str, int, int, Callable[[], Any]]] = []
    for n in backend.decode_rows(cache.max_batch):  # as `decode` calls it
        zeros = np.zeros(n, np.int32)
        windows = backend.windows(n) if lora_pool is not None else (None,)
        for attend_len in sorted({backend.attend_len(cache, p) for p in attend_lens}):
            for window in windows:
                jobs.append(("decode", n, 0, functools.partial(
                    lambda z, a, w: decode_jit.lower(params, pool_s, cache_s, z, z, z, np.zeros(len(z), np.bool_),
                                                     rope_tables(z, params.config), attend_len=a, window=w,
                                                     rows=None if len(z) == cache.max_batch else z).compile(),
                    zeros, attend_len, window)))
    row = np.int32(0)
    jobs.append(("fork", 1, 0, lambda: kv_cache.copy_row.lower(cache_s, row, row).compile()))  # n > 1
    if store is not None:
        store_s = shapes(store)
        for m in block_counts:  # as `Runner.load_blocks` and `save_blocks` call them
            ids = np.zeros(m, np.int32)
            jobs.append(("blocks", m, 0, functools.partial(
                lambda i: (kv_blocks.load_row.lower(cache_s, store_s, row, i).compile(),
                           kv_blocks.save_row.lower(store_s, cache_s, row, i, i).compile()), ids)))
    for kind, fn, shape_list in (("prefill", prefill_jit, prefill_shapes), ("extend", extend_jit, extend_shapes)):
        for n, p in shape_list:  # as `prefill_batch` calls it (with starts: extend)
            per_prompt = np.zeros(n, np.int32)
            args = (per_prompt,) * (3 if kind == "prefill" else 4)
            jobs.append((kind, n, p, functools.partial(
                lambda f, t, a: f.lower(params, pool_s, cache_s, t, *a).compile(), fn,
                np.zeros((n, p), np.int32), args)))
    # prompt logprobs' LM head over hidden states (computed/model/scores.py): one shape
    jobs.append(("score", 1, 0, functools.partial(scores.lower_score, params, jnp.dtype(params.dtype))))

    def run(job: tuple[str, int, int, Callable[[], Any]]) -> None:
        if not stop():
            job[3]()
            compiled(*job[:3])

    # two compiles at a time: XLA compiles one on one thread, and a cache hit's read of the
    # executable leaves the interpreter to the other's tracing (`threads`)
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="compile") as pool:
        if ready is None:
            list(pool.map(run, jobs))
            return
        top = max(block_counts, default=0)
        first = [j for j in jobs if essential(j[0], j[1], cache.max_batch, top)]
        list(pool.map(run, first))  # what every request needs
        if stop():
            return
        ready()
        list(pool.map(run, [j for j in jobs if j not in first]))


def essential(kind: str, n: int, max_batch: int, top_blocks: int) -> bool:
    """Whether a replica needs this forward compiled before it serves: a decode step of every row
    (fewer rows run on it meanwhile), one prompt's prefill and chunk at each length (several run
    one by one meanwhile), and the prefix cache's copies of the most blocks (fewer are padded to
    them meanwhile: a copy of a whole row, about 2 ms at the 0.5B geometry)."""
    if kind == "blocks":
        return n == top_blocks
    if kind == "score":
        return True
    return n == max_batch if kind == "decode" else n == 1
