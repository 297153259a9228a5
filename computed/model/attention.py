"""Attention in XLA: causal over a whole sequence (prefill, `forward_full`), and a decode step's over
a bucket of the KV cache (the portable backends' decode attention; the native kernel reads each
row's own positions instead, computed/backend/native.py).

Grouped-query: q [..., kv_heads, group, head_dim] against k and v [..., kv_heads, head_dim]
(query head h uses key/value head h // group); softmax in float32. Each layer's options, as
transformers' eager attention has them (models/gemma2/modeling_gemma2.py `eager_attention_forward`,
masking_utils.py `sliding_window_overlay`):

- `scale`: scores are q . k * scale (None: head_dim**-0.5; Gemma's query_pre_attn_scalar**-0.5,
  Granite's attention_multiplier).
- `softcap`: scores become softcap * tanh(scores / softcap) before the mask (0: none; Gemma 2),
  in float32.
- `window`: the query at position i attends keys j with i - window < j <= i, its own position
  counted (0: all of [0, i]; Mistral, Gemma's local layers).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from computed.model import kv_cache
from computed.model.kv_cache import KVCache


def check_options(window: int, softcap: float) -> None:
    """ValueError for a window or a softcap that no layer can have."""
    if window < 0:
        raise ValueError(f"attention window {window}: expected 0 (none) or a positive number of positions")
    if softcap < 0:
        raise ValueError(f"attention softcap {softcap}: expected 0 (none) or a positive cap")


def softmax(scores: jax.Array, mask: jax.Array, dtype: jnp.dtype, softcap: float = 0.0) -> jax.Array:
    """softmax over the last axis of `scores` (soft-capped first where `softcap`) where `mask`, in
    float32, cast to `dtype`."""
    scores = scores.astype(jnp.float32)
    if softcap:
        scores = softcap * jnp.tanh(scores / softcap)
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    return jax.nn.softmax(scores, axis=-1).astype(dtype)


def causal(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float | None = None, window: int = 0,
           softcap: float = 0.0) -> jax.Array:
    """q [..., T, kv, g, d], k and v [..., T, kv, d] -> [..., T, heads * d], causal (within `window`
    positions where it is set)."""
    check_options(window, softcap)
    t = q.shape[-4]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = jnp.einsum("...qkgd,...skd->...kgqs", q, k) * scale
    query, key = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    mask = query >= key
    if window:
        mask &= key > query - window
    probs = softmax(scores, mask, q.dtype, softcap)
    out = jnp.einsum("...kgqs,...skd->...qkgd", probs, v)
    return out.reshape(*out.shape[:-3], -1)


def bucket(q: jax.Array, k: jax.Array, v: jax.Array, cache: KVCache, layer: int, positions: jax.Array,
           active: jax.Array, attend_len: int, *, scale: float | None = None, window: int = 0,
           softcap: float = 0.0) -> tuple[jax.Array, KVCache]:
    """One decode step over the first `attend_len` cache positions of every row (static: one compile
    per length bucket), so a step costs what the longest running sequence needs, not what the cache
    could hold. Writes k and v [B, kv, d] at positions[b] of each active row b first, then attends
    q [B, kv, g, d] over [0, positions[b]] (over (positions[b] - window, positions[b]] where
    `window` is set): (out [B, heads * d], the updated cache)."""
    check_options(window, softcap)
    cache = kv_cache.write_step(cache, layer, positions, active, k, v)
    keys, values = kv_cache.read(cache, layer, attend_len)
    key = jnp.arange(attend_len)[None, :]
    visible = key <= positions[:, None]
    if window:
        visible &= key > positions[:, None] - window
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = jnp.einsum("bkgd,bkds->bkgs", q, keys) * scale
    probs = softmax(scores, visible[:, None, None, :], q.dtype, softcap)
    return jnp.einsum("bkgs,bksd->bkgd", probs, values).reshape(q.shape[0], -1), cache


def chunk(q: jax.Array, keys: jax.Array, values: jax.Array, positions: jax.Array, *,
          scale: float | None = None, window: int = 0, softcap: float = 0.0) -> jax.Array:
    """A prompt chunk's attention over its row's cache, the chunk's own k and v written there
    first: q [n, C, kv, g, d] at `positions [n, C]` against keys [n, kv, d, L] and values
    [n, kv, L, d] of cache positions [0, L) -> [n, C, heads * d]; the query at position p
    attends keys j <= p (within `window` where it is set)."""
    check_options(window, softcap)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = jnp.einsum("nckgd,nkdl->nkgcl", q, keys) * scale
    key = jnp.arange(keys.shape[-1])[None, None, :]
    visible = key <= positions[:, :, None]  # [n, C, L]
    if window:
        visible &= key > positions[:, :, None] - window
    probs = softmax(scores, visible[:, None, None], q.dtype, softcap)
    out = jnp.einsum("nkgcl,nkld->nckgd", probs, values)
    return out.reshape(*out.shape[:2], -1)
