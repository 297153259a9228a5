"""The KV cache for continuous batching, in either of its two layouts of K, and the writes into it.

V `[layers, max_batch, kv_heads, max_len, head_dim]` and K in blocks of 16 positions
`[layers, max_batch, kv_heads, blocks, head_dim, 16]` for the attention kernel, or
positions-minor `[layers, max_batch, kv_heads, head_dim, max_len]` for XLA's attention, in the
model dtype; each running sequence owns one batch row. Heads come before positions so that
attention reads the cache in place (with positions first, XLA on CPU transposes every layer's K
and V before each step's matmuls, and a decode step takes about three times as long).
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from computed.model.config import DecoderConfig

KV_BLOCK = 16  # positions per block of K (KVCache); computed/backend/kernels/attention.cc assumes it


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class KVCache:
    """V [layers, max_batch, kv_heads, max_len, head_dim]; K in one of two layouts, by what attends:

    - blocked, for the attention kernel: K [layers, max_batch, kv_heads, ceil(max_len / 16),
      head_dim, 16], positions in blocks of KV_BLOCK (block j, dimension e, lane c is position
      16j + c). A row's first positions lie together; with K wholly positions-minor, a short row
      touched head_dim scattered cache lines per (row, head), and the kernel spent its time
      waiting on them. Positions past max_len in the last block are never read.
    - positions-minor, for XLA's attention: K [layers, max_batch, kv_heads, head_dim, max_len],
      so a step's scores are a [g, d] x [d, L] product per row and head (measured about 30%
      cheaper than K laid out like V). XLA read the blocked layout markedly slower deep in a
      long cache.

    Within a block positions are minor too, so both give the kernel and XLA sixteen positions per
    vector."""

    k: jax.Array
    v: jax.Array

    @property
    def max_batch(self) -> int:
        return int(self.v.shape[1])

    @property
    def max_len(self) -> int:
        return int(self.v.shape[3])

    @property
    def blocked(self) -> bool:
        """Whether K is in blocks of positions (the attention kernel's layout)."""
        return self.k.ndim == 6


def blocks(positions: int) -> int:
    """Blocks of K that hold `positions` positions."""
    return -(-positions // KV_BLOCK)


def zeros(config: DecoderConfig, max_batch: int, max_len: int, dtype: str | jnp.dtype, *, blocked: bool) -> KVCache:
    """A zeroed cache of `max_batch` rows of `max_len` positions; K blocked or positions-minor."""
    lead = (config.num_layers, max_batch, config.num_kv_heads)
    k_shape = (blocks(max_len), config.head_dim, KV_BLOCK) if blocked else (config.head_dim, max_len)
    return KVCache(k=jnp.zeros(lead + k_shape, dtype), v=jnp.zeros(lead + (max_len, config.head_dim), dtype))


def write_prompts(cache: KVCache, layer: int, rows: jax.Array, k: jax.Array, v: jax.Array,
                  starts: jax.Array | None = None) -> KVCache:
    """Prompts' k and v [n, P, kv, d] into positions [starts[i], starts[i] + P) (by default [0, P))
    of rows `rows [n]` of layer `layer`, prompt i into row rows[i]: one scatter per array, whatever
    n (a slice write per prompt made a prefill's compile grow with its prompts: 4.3 s for one
    prompt of 16 tokens at Qwen2.5-0.5B's 24 layers, 26.5 s for 16 of them). A row named twice
    must be given the same k and v twice, as the runner's padding of n does. A start is a
    multiple of KV_BLOCK and start + P at most max_len (the runner's chunks)."""
    n, p, kv, d = k.shape
    at = jnp.zeros(n, jnp.int32) if starts is None else starts.astype(jnp.int32)
    row = rows.astype(jnp.int32)[:, None]
    if cache.blocked:  # [n, P / 16, kv, d, 16] into blocks at / 16 on
        nb = blocks(p)
        kb = jnp.pad(k, ((0, 0), (0, nb * KV_BLOCK - p), (0, 0), (0, 0))).reshape(n, nb, KV_BLOCK, kv, d)
        at_block = at[:, None] // KV_BLOCK + jnp.arange(nb, dtype=jnp.int32)[None, :]
        k_cache = cache.k.at[layer, row, :, at_block].set(jnp.transpose(kb, (0, 1, 3, 4, 2)).astype(cache.k.dtype))
    else:  # [n, P, kv, d] into positions-minor K
        k_cache = cache.k.at[layer, row, :, :, at[:, None] + jnp.arange(p, dtype=jnp.int32)[None, :]].set(
            k.astype(cache.k.dtype))
    positions = at[:, None] + jnp.arange(p, dtype=jnp.int32)[None, :]
    v_cache = cache.v.at[layer, row, :, positions].set(v.astype(cache.v.dtype))
    return KVCache(k_cache, v_cache)


def write_step(cache: KVCache, layer: int, positions: jax.Array, active: jax.Array, k: jax.Array,
               v: jax.Array) -> KVCache:
    """One decode step's k and v [B, kv, d] at positions[b] of each active row b of layer `layer`;
    inactive rows write nothing (their index is pushed out of range and dropped)."""
    rows = jnp.arange(k.shape[0])
    if cache.blocked:
        block_at = jnp.where(active, positions // KV_BLOCK, cache.k.shape[3])  # out of range: dropped
        k_cache = cache.k.at[layer, rows, :, block_at, :, positions % KV_BLOCK].set(k.astype(cache.k.dtype),
                                                                                   mode="drop")
    else:
        write_at = jnp.where(active, positions, cache.max_len)
        k_cache = cache.k.at[layer, rows, :, :, write_at].set(k.astype(cache.k.dtype), mode="drop")
    write_at = jnp.where(active, positions, cache.max_len)  # out of range: dropped, the cache is untouched
    v_cache = cache.v.at[layer, rows, :, write_at].set(v.astype(cache.v.dtype), mode="drop")
    return KVCache(k_cache, v_cache)


def read(cache: KVCache, layer: int, attend_len: int, rows: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Keys [B, kv, d, L] and values [B, kv, L, d] of the first `attend_len` positions of every row,
    or of `rows [n]` alone ([n, ...])."""
    k, v = cache.k[layer], cache.v[layer]
    if rows is not None:
        k, v = k[rows], v[rows]
    if cache.blocked:  # the kernel's layout, read by XLA (tests, comparisons, prefill chunks)
        keys = jax.lax.slice_in_dim(k, 0, blocks(attend_len), axis=2)  # [B, kv, L / 16, d, 16]
        keys = jnp.swapaxes(keys, 2, 3).reshape(*keys.shape[:2], keys.shape[3], -1)[..., :attend_len]
    else:
        keys = jax.lax.slice_in_dim(k, 0, attend_len, axis=3)  # [B, kv, d, L]
    values = jax.lax.slice_in_dim(v, 0, attend_len, axis=2)  # [B, kv, L, d]
    return keys, values


def _copy_row(cache: KVCache, src: jax.Array, dst: jax.Array) -> KVCache:
    """Row `src`'s K and V, every position of every layer, into row `dst`."""
    def copy(a: jax.Array) -> jax.Array:
        return jax.lax.dynamic_update_slice_in_dim(a, jax.lax.dynamic_slice_in_dim(a, src, 1, axis=1), dst, axis=1)
    return KVCache(copy(cache.k), copy(cache.v))


# the KV fork of a request's choices (n > 1): its prompt prefilled once, into its first row, then
# copied into the others (computed/serving/prefill.py); one compile, whatever the rows
copy_row = jax.jit(_copy_row, donate_argnames="cache")
