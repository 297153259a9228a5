"""The prefix cache's block store: KV of 16-position blocks, outside the running rows.

K `[blocks, layers, kv_heads, head_dim, 16]` and V `[blocks, layers, kv_heads, 16, head_dim]` in
the cache's dtype: one block of one row of the KV cache (computed/model/kv_cache.py), every layer
of it, in either K layout (a K block of the attention kernel's layout, or 16 positions of
positions-minor K, are both [head_dim, 16]). Which block holds what is the host's business
(computed/serving/prefix_cache.py); here are the two copies, each one jitted call per row:

- `load_row`: blocks `ids` of the store into a row's first len(ids) blocks, before the rest of
  the prompt is prefilled from there. Ids past the hit are padding (the count is a bucket): what
  they write lies beyond the row's sequence and is overwritten before it is ever read.
- `save_row`: a row's blocks `src` into store blocks `dst`, after its prompt is prefilled;
  a `dst` of the store's size is padding and dropped.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from computed.model.config import DecoderConfig
from computed.model.kv_cache import KV_BLOCK, KVCache


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class KVBlocks:
    k: jax.Array  # [N, layers, kv, d, 16]
    v: jax.Array  # [N, layers, kv, 16, d]

    @property
    def size(self) -> int:
        return int(self.k.shape[0])


def block_bytes(config: DecoderConfig, dtype: jnp.dtype) -> int:
    """Bytes of one block: K and V of 16 positions over every layer."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * KV_BLOCK * jnp.dtype(dtype).itemsize


def zeros(config: DecoderConfig, n: int, dtype: jnp.dtype) -> KVBlocks:
    lead = (n, config.num_layers, config.num_kv_heads)
    return KVBlocks(k=jnp.zeros(lead + (config.head_dim, KV_BLOCK), dtype),
                    v=jnp.zeros(lead + (KV_BLOCK, config.head_dim), dtype))


def _load_row(cache: KVCache, store: KVBlocks, row: jax.Array, ids: jax.Array) -> KVCache:
    m = ids.shape[0]
    k = store.k[ids]  # [m, L, kv, d, 16]
    v = jnp.transpose(store.v[ids], (1, 2, 0, 3, 4))  # [L, kv, m, 16, d]
    v = v.reshape(*v.shape[:2], m * KV_BLOCK, v.shape[-1])[:, None]
    if cache.blocked:
        k = jnp.transpose(k, (1, 2, 0, 3, 4))[:, None]  # [L, 1, kv, m, d, 16]
        k_cache = jax.lax.dynamic_update_slice(cache.k, k, (0, row, 0, 0, 0, 0))
    else:
        k = jnp.transpose(k, (1, 2, 3, 0, 4))  # [L, kv, d, m, 16]
        k = k.reshape(*k.shape[:3], m * KV_BLOCK)[:, None]
        k_cache = jax.lax.dynamic_update_slice(cache.k, k, (0, row, 0, 0, 0))
    return KVCache(k_cache, jax.lax.dynamic_update_slice(cache.v, v, (0, row, 0, 0, 0)))


def _save_row(store: KVBlocks, cache: KVCache, row: jax.Array, src: jax.Array, dst: jax.Array) -> KVBlocks:
    at = (src[:, None] * KV_BLOCK + jnp.arange(KV_BLOCK)[None, :])  # [m, 16] positions
    v = jnp.take(cache.v[:, row], at, axis=2)  # [L, kv, m, 16, d]
    if cache.blocked:
        k = jnp.take(cache.k[:, row], src, axis=2)  # [L, kv, m, d, 16]
    else:
        k = jnp.moveaxis(jnp.take(cache.k[:, row], at, axis=3), 3, 2)  # [L, kv, m, d, 16]
    return KVBlocks(store.k.at[dst].set(jnp.moveaxis(k, 2, 0), mode="drop"),
                    store.v.at[dst].set(jnp.moveaxis(v, 2, 0), mode="drop"))


load_row = jax.jit(_load_row, donate_argnames="cache")
save_row = jax.jit(_save_row, donate_argnames="store")
