"""Attention in XLA: causal over a whole sequence (prefill, `forward_full`), and a decode step's over
a bucket of the KV cache (the portable backends' decode attention; the native kernel reads each
row's own positions instead, computed/backend/native.py).

Grouped-query: q [..., kv_heads, group, head_dim] against k and v [..., kv_heads, head_dim]
(query head h uses key/value head h // group); scores scaled by head_dim**-0.5, softmax in float32.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from computed.model import kv_cache
from computed.model.kv_cache import KVCache


def softmax(scores: jax.Array, mask: jax.Array, dtype: jnp.dtype) -> jax.Array:
    scores = jnp.where(mask, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    return jax.nn.softmax(scores, axis=-1).astype(dtype)


def causal(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """q [..., T, kv, g, d], k and v [..., T, kv, d] -> [..., T, heads * d], causal."""
    t = q.shape[-4]
    scores = jnp.einsum("...qkgd,...skd->...kgqs", q, k) * (q.shape[-1] ** -0.5)
    mask = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
    probs = softmax(scores, mask, q.dtype)
    out = jnp.einsum("...kgqs,...skd->...qkgd", probs, v)
    return out.reshape(*out.shape[:-3], -1)


def bucket(q: jax.Array, k: jax.Array, v: jax.Array, cache: KVCache, layer: int, positions: jax.Array,
           active: jax.Array, attend_len: int) -> tuple[jax.Array, KVCache]:
    """One decode step over the first `attend_len` cache positions of every row (static: one compile
    per length bucket), so a step costs what the longest running sequence needs, not what the cache
    could hold. Writes k and v [B, kv, d] at positions[b] of each active row b first, then attends
    q [B, kv, g, d] over [0, positions[b]]: (out [B, heads * d], the updated cache)."""
    cache = kv_cache.write_step(cache, layer, positions, active, k, v)
    keys, values = kv_cache.read(cache, layer, attend_len)
    visible = (jnp.arange(attend_len)[None, :] <= positions[:, None])[:, None, None, :]
    scores = jnp.einsum("bkgd,bkds->bkgs", q, keys) * (q.shape[-1] ** -0.5)
    probs = softmax(scores, visible, q.dtype)
    return jnp.einsum("bkgs,bksd->bkgd", probs, values).reshape(q.shape[0], -1), cache
