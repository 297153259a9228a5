"""The LoRA term of one linear layer, `scaling[s] * B[s] @ (A[s] @ x)`, for rows that mix slots.

Pool layout (computed/pool.py), for one layer of one target module:
`A [slots, max_rank, in]`, `B [slots, out, max_rank]`, `scaling [slots]`. A slot
of -1 means the base model: its rows get no LoRA term (exactly zero).

Two shapes of input:

- one slot for every row (a prefill): `single` takes that slot's A and B with a
  dynamic index, two small matmuls, nothing per token.
- rows that mix slots (a decode step): `segmented`, after Punica's SGMV and
  S-LoRA. Rows are sorted by slot and each slot's run of rows is cut into
  windows of `window` rows (8 by default); `Segments` lists the windows (slot,
  first sorted row, real rows) in a fixed-size array padded past `count`. A
  loop whose trip count is `count` takes one window per iteration: the slot's A
  and B by dynamic index (read from the pool, never gathered per token or per
  row), `window` consecutive sorted rows by dynamic slice, rows past the run
  masked. The work is about (N + distinct * window) rows of rank-r products,
  not N * distinct. Every shape is static: a change in the mix of adapters
  changes `count` and the window table, never a shape, so it never recompiles.
  Base rows (-1) sort last and get no window.

Why this scheme: benchmarks/bench_lora.py times it beside a naive per-row
gather, a loop over distinct slots applied to every row, `jax.lax.ragged_dot`
(which on CPU lowers to a dense masked product over every group: several times
slower) and a blocked batched matmul with weights gathered per block; on CPU it
is the fastest grouped scheme and about as fast as the gather or faster.

The arithmetic follows PEFT's `Linear.forward`: `(x @ A.T) @ B.T * scaling`,
in the wider of the activation and pool dtypes; callers add the result to the
base layer's output and cast back to their dtype.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp

BASE = -1  # the slot id of a row that uses the base model
WINDOW = 4  # rows per window of `segmented`


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["slots", "order", "inverse", "window_slot", "window_start", "window_rows",
                                "count"],
                   meta_fields=["window"])
@dataclass(frozen=True)
class Segments:
    """A batch's rows grouped by slot and cut into windows; computed once, shared by every layer and module.

    slots         [N]  int32  each row's slot, BASE for the base model
    order         [N]  int32  rows sorted by slot (stable), base rows last
    inverse       [N]  int32  the sorted position of each row
    window_slot   [NW] int32  per window: its slot
    window_start  [NW] int32  per window: its first row, in sorted order
    window_rows   [NW] int32  per window: how many of its `window` rows are its slot's
    count         []   int32  windows in use; entries from `count` on are padding, never read
    window        static      rows per window
    """

    slots: jax.Array
    order: jax.Array
    inverse: jax.Array
    window_slot: jax.Array
    window_start: jax.Array
    window_rows: jax.Array
    count: jax.Array
    window: int


def segments(slots: jax.Array, num_slots: int, *, window: int = WINDOW) -> Segments:
    """Group rows by slot: `slots [N]` int32 in [BASE, num_slots)."""
    slots = jnp.asarray(slots, jnp.int32)
    n = slots.shape[0]
    key = jnp.where(slots >= 0, slots, num_slots)  # base rows sort last and get no window
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    inverse = jnp.zeros((n,), jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32))
    counts = jnp.bincount(key, length=num_slots + 1)[:num_slots].astype(jnp.int32)
    first_row = jnp.cumsum(counts) - counts
    per_slot = -(-counts // window)
    ends = jnp.cumsum(per_slot)
    # sum over slots of ceil(count / window) <= n // window + distinct slots
    j = jnp.arange(n // window + min(n, num_slots), dtype=jnp.int32)
    slot = jnp.minimum(jnp.searchsorted(ends, j, side="right"), num_slots - 1).astype(jnp.int32)
    k = j - (ends[slot] - per_slot[slot])  # the window's index within its slot's rows
    return Segments(slots=slots, order=order, inverse=inverse, window_slot=slot,
                    window_start=first_row[slot] + k * window,
                    window_rows=jnp.clip(counts[slot] - k * window, 0, window),
                    count=ends[-1], window=window)


def _compute_dtype(x: jax.Array, A: jax.Array) -> jnp.dtype:
    return jnp.promote_types(x.dtype, A.dtype)


def _slot_scale(scaling: jax.Array, slot: jax.Array) -> jax.Array:
    return jnp.where(slot >= 0, scaling[jnp.maximum(slot, 0)], 0.0)


def _take(pool: jax.Array, layer: int | None, slot: jax.Array) -> jax.Array:
    """One slot's matrix from `pool` ([layers, slots, ...] with `layer`, else [slots, ...]),
    by dynamic slice of the whole pool array: slicing out the layer first would make XLA copy
    that layer's slots for every module on every step (the pool is an input of the loop)."""
    if layer is None:
        return jax.lax.dynamic_index_in_dim(pool, slot, 0, keepdims=False)
    start = (layer, slot) + (0,) * (pool.ndim - 2)
    return jax.lax.dynamic_slice(pool, start, (1, 1) + pool.shape[2:])[0, 0]


def single(x: jax.Array, A: jax.Array, B: jax.Array, scaling: jax.Array, slot: jax.Array,
           layer: int | None = None) -> jax.Array:
    """The LoRA term of `slot` for every row of `x [..., in]`: `[..., out]` (zero when slot is BASE).

    `A` and `B` are one layer's `[slots, ...]`, or with `layer` the whole `[layers, slots, ...]`."""
    dt = _compute_dtype(x, A)
    s = jnp.maximum(slot, 0)
    a = _take(A, layer, s).astype(dt)  # [r, in]
    b = _take(B, layer, s).astype(dt)  # [out, r]
    y = (x.astype(dt) @ a.T) @ b.T
    return jnp.where(slot >= 0, y * _slot_scale(scaling, slot).astype(dt), jnp.zeros((), dt))


def segmented(x: jax.Array, A: jax.Array, B: jax.Array, scaling: jax.Array, seg: Segments,
              layer: int | None = None) -> jax.Array:
    """The LoRA term of each row of `x [N, in]` with its own slot (`seg.slots`): `[N, out]`.

    `A` and `B` are one layer's `[slots, ...]`, or with `layer` the whole `[layers, slots, ...]`."""
    dt = _compute_dtype(x, A)
    n, n_in = x.shape
    w = seg.window
    # Sorted rows, padded so that a window starting at any row stays in bounds (no clamping).
    xs = jnp.concatenate([x.astype(dt)[seg.order], jnp.zeros((w, n_in), dt)])
    in_window = jnp.arange(w)

    def one_window(i: jax.Array, y: jax.Array) -> jax.Array:
        u, start = seg.window_slot[i], seg.window_start[i]
        a = _take(A, layer, u).astype(dt)  # [r, in]
        b = _take(B, layer, u).astype(dt)  # [out, r]
        t = jax.lax.dynamic_slice_in_dim(xs, start, w) @ a.T
        t = jnp.where((in_window < seg.window_rows[i])[:, None], t, jnp.zeros((), dt))
        part = jax.lax.dynamic_slice_in_dim(y, start, w) + t @ b.T
        return jax.lax.dynamic_update_slice_in_dim(y, part, start, 0)

    y = jax.lax.fori_loop(0, seg.count, one_window, jnp.zeros((n + w, B.shape[-2]), dt))
    return y[:n][seg.inverse] * _slot_scale(scaling, seg.slots).astype(dt)[:, None]
