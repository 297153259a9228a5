"""The LoRA term of a linear layer, `scaling[s] * B[s] @ (A[s] @ x)`, for rows that mix slots.

Pool layout (computed/residency/pool.py), for one layer of one target module:
`A [slots, max_rank, in]`, `B [slots, out, max_rank]`, `scaling [slots]`. A slot
of -1 means the base model: its rows get no LoRA term (exactly zero).

Two shapes of input:

- one slot for every row: `single` takes that slot's A and B with a dynamic
  index, two small matmuls, nothing per token (tests; serving's prefill batches
  prompts of any slots, each prompt's tokens one segment of its slot, below).
- rows that mix slots (a decode step, a batched prefill): `segmented`, after Punica's SGMV and
  S-LoRA. Each slot's rows are laid out one after the other, every slot's run
  padded to a whole number of windows of `window` rows, in a buffer of a fixed
  `rows` rows (`Segments`). A loop whose trip count is the number of windows in
  use takes one window per iteration: its slot's A and B by dynamic index (read
  from the pool, never gathered per token or per row) and its `window` rows by
  dynamic slice. Windows never share rows, so an iteration only writes its
  output rows: no mask, no read-modify-write. The modules that read the same
  input (q, k and v; gate and up) share one loop, so a decoder layer runs four
  loops, not seven. Every shape is static: a change in the mix of adapters
  changes the trip count and the tables, never a shape, so it never recompiles.
  Base rows (-1) get no window.

The window is static, one compile per size: the host picks it per step from the
batch's mix (`choose_window`: the fewest windows whose padding fits the
buffer), among `loop_windows(batch)`, which the engine compiles at warm-up: 16
adapters on pairs of rows take 16 windows of 2, 4 adapters on 8 rows each 4
windows of 8, one adapter for the whole batch one window. On CPU a window costs
about the same whatever its rows (the small products stream the slot's A and B
from memory), so fewer windows is what counts, and padded rows are what a
larger window wastes.

On the CPU, when the native kernels are built, the native backend
(computed/backend/native.py) takes the LoRA terms from its SGMV kernel instead
of the window loop: rows stay in batch order, the kernel groups them by slot and
reads each slot's A and B once, in place in the pool, and stops at the slot's own
rank. XLA cannot do that: each iteration of the window loop copies the slot's
matrices out of the pool before its small products, and that copy, not the
arithmetic, is most of the loop's cost. The window loop is the XLA backend's
(computed/backend/xla.py); both give the same terms to float32 rounding.

`gather` is the per-token alternative (BGMV-style: every row gathers its own
slot's A and B), for benchmarks only; serving never uses it.

The arithmetic follows PEFT's `Linear.forward`: `(x @ A.T) @ B.T * scaling`,
in the wider of the activation and pool dtypes; callers add the result to the
base layer's output and cast back to their dtype.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

BASE = -1  # the slot id of a row that uses the base model
WINDOWS = (2, 8)  # window sizes decode compiles below the batch size, which it compiles too
WINDOW = 4  # rows per window when the caller does not choose (forward_full, tests)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["slots", "position", "source", "window_slot", "count"],
                   meta_fields=["window"])
@dataclass(frozen=True)
class Segments:
    """A batch's rows grouped by slot, padded to whole windows; computed once, shared by every layer and module.

    slots        [N]  int32  each row's slot, BASE for the base model
    position     [N]  int32  each row's row of the padded layout; base rows: R, a row no window writes
    source       [R]  int32  each padded row's batch row, N for padding (reads as zeros)
    window_slot  [R // window] int32  per window: its slot (window i holds padded rows [i*window, (i+1)*window))
    count        []   int32  windows in use; entries from `count` on are padding, never read
    window       static      rows per window
    """

    slots: jax.Array
    position: jax.Array
    source: jax.Array
    window_slot: jax.Array
    count: jax.Array
    window: int


def padded_rows(slots: np.ndarray, window: int) -> int:
    """Rows of the padded layout `slots` (host) needs with `window`: each slot's rows rounded up to whole windows."""
    counts = np.bincount(slots[slots >= 0])
    return int((-(-counts // window)).sum()) * window


def loop_windows(batch: int) -> tuple[int, ...]:
    """The window-loop sizes for a batch of `batch` rows: WINDOWS below it, and the batch itself."""
    return tuple(w for w in WINDOWS if w < batch) + (batch,)


def choose_window(slots: np.ndarray, windows: Sequence[int]) -> int:
    """The window of `windows` (each at most the batch) with the fewest windows whose padding fits
    2 * batch rows.

    The smallest window always fits when it is 1 or 2 (a slot's padding is under a window)."""
    n = len(slots)
    best = None
    for w in sorted(windows):
        padded = padded_rows(slots, w)
        if padded <= 2 * n and (best is None or padded // w < best[0]):
            best = (padded // w, w)
    if best is None:
        raise ValueError(f"no window of {tuple(windows)} fits the mix of {n} rows in {2 * n} rows")
    return best[1]


def segments(slots: jax.Array, num_slots: int, *, window: int = WINDOW, rows: int | None = None) -> Segments:
    """Group rows by slot: `slots [N]` int32 in [BASE, num_slots).

    `rows` is the padded layout's size: by default enough for any mix; a caller that
    checked the mix (`padded_rows`) may pass less (decode passes 2 * N). Windows that
    do not fit are dropped, so a mix that needs more rows gets wrong results."""
    slots = jnp.asarray(slots, jnp.int32)
    n = slots.shape[0]
    if rows is None:
        rows = n + min(n, num_slots) * (window - 1)
    key = jnp.where(slots >= 0, slots, num_slots)  # base rows sort last and get no window
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    counts = jnp.bincount(key, length=num_slots + 1)[:num_slots].astype(jnp.int32)
    per_slot = -(-counts // window)  # windows per slot
    ends = jnp.cumsum(per_slot)
    first_row = jnp.cumsum(counts) - counts  # in sorted order
    first_padded = (ends - per_slot) * window
    sorted_key = key[order]
    safe = jnp.minimum(sorted_key, num_slots - 1)
    at = first_padded[safe] + jnp.arange(n, dtype=jnp.int32) - first_row[safe]
    at = jnp.where(sorted_key < num_slots, at, rows).astype(jnp.int32)  # base rows: the zero row
    position = jnp.zeros((n,), jnp.int32).at[order].set(at)
    source = jnp.full((rows,), n, jnp.int32).at[at].set(order, mode="drop")
    j = jnp.arange(rows // window, dtype=jnp.int32)
    window_slot = jnp.minimum(jnp.searchsorted(ends, j, side="right"), num_slots - 1).astype(jnp.int32)
    return Segments(slots=slots, position=position, source=source, window_slot=window_slot,
                    count=jnp.minimum(ends[-1], rows // window), window=window)


def pool_dtype(a: jax.Array) -> jnp.dtype:
    """The dtype a pool array holds: bfloat16 pools keep their bits as uint16 (computed/residency/pool.py)."""
    return jnp.dtype(jnp.bfloat16) if a.dtype == jnp.uint16 else a.dtype


def widen(a: jax.Array, dt: jnp.dtype) -> jax.Array:
    """A slice of a pool array as `dt`. A bfloat16 pool's uint16 bits become float32 by a shift,
    which is exact; XLA then never sees a bfloat16 array it would widen whole, outside the loop."""
    if a.dtype == jnp.uint16:
        a = jax.lax.bitcast_convert_type(a.astype(jnp.uint32) << 16, jnp.float32)
    return a.astype(dt)


def _compute_dtype(x: jax.Array, A: jax.Array) -> jnp.dtype:
    return jnp.promote_types(x.dtype, pool_dtype(A))


def _slot_scale(scaling: jax.Array, slot: jax.Array) -> jax.Array:
    return jnp.where(slot >= 0, scaling[jnp.maximum(slot, 0)], 0.0)


def _take(pool: jax.Array, layer: int | None, slot: jax.Array) -> jax.Array:
    """One slot's matrix from `pool` ([layers, slots, ...] with `layer`, else [slots, ...]),
    by dynamic slice of the whole pool array: slicing out the layer first would make XLA copy
    that layer's slots for every module on every step (the pool is an input of the loop)."""
    if layer is None:
        whole: jax.Array = jax.lax.dynamic_index_in_dim(pool, slot, 0, keepdims=False)
        return whole
    start = (layer, slot) + (0,) * (pool.ndim - 2)
    return jax.lax.dynamic_slice(pool, start, (1, 1) + pool.shape[2:])[0, 0]


def single(x: jax.Array, A: jax.Array, B: jax.Array, scaling: jax.Array, slot: jax.Array,
           layer: int | None = None) -> jax.Array:
    """The LoRA term of `slot` for every row of `x [..., in]`: `[..., out]` (zero when slot is BASE).

    `A` and `B` are one layer's `[slots, ...]`, or with `layer` the whole `[layers, slots, ...]`."""
    dt = _compute_dtype(x, A)
    s = jnp.maximum(slot, 0)
    a = widen(_take(A, layer, s), dt)  # [r, in]
    b = widen(_take(B, layer, s), dt)  # [out, r]
    y = (x.astype(dt) @ a.T) @ b.T
    return jnp.where(slot >= 0, y * _slot_scale(scaling, slot).astype(dt), jnp.zeros((), dt))


def segmented_group(x: jax.Array, pairs: Sequence[tuple[jax.Array, jax.Array]], scaling: jax.Array,
                    seg: Segments, layer: int | None = None) -> list[jax.Array]:
    """The LoRA terms of several modules that read the same `x [N, in]`, each row with its own slot
    (`seg.slots`), in one loop over the windows: `[N, out]` per (A, B) pair of `pairs`.

    Each `A` and `B` is one layer's `[slots, ...]`, or with `layer` the whole `[layers, slots, ...]`."""
    dt = functools.reduce(jnp.promote_types, [pool_dtype(A) for A, _ in pairs], x.dtype)
    w, rows = seg.window, seg.source.shape[0]
    # the padded layout, and one zero row past it for the padding's source
    xs = jnp.concatenate([x.astype(dt), jnp.zeros((1, x.shape[1]), dt)])[seg.source]

    def one_window(i: jax.Array, ys: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        u, start = seg.window_slot[i], i * w
        xw = jax.lax.dynamic_slice_in_dim(xs, start, w)
        out = []
        for (A, B), y in zip(pairs, ys):
            t = xw @ widen(_take(A, layer, u), dt).T  # [w, r]
            out.append(jax.lax.dynamic_update_slice_in_dim(y, t @ widen(_take(B, layer, u), dt).T, start, 0))
        return tuple(out)

    # one more row than the layout: base rows read it, and no window writes it
    ys = jax.lax.fori_loop(0, seg.count, one_window,
                           tuple(jnp.zeros((rows + 1, B.shape[-2]), dt) for _, B in pairs))
    scale = _slot_scale(scaling, seg.slots).astype(dt)[:, None]
    return [y[seg.position] * scale for y in ys]


def segmented(x: jax.Array, A: jax.Array, B: jax.Array, scaling: jax.Array, seg: Segments,
              layer: int | None = None) -> jax.Array:
    """The LoRA term of each row of `x [N, in]` with its own slot (`seg.slots`): `[N, out]`.

    `A` and `B` are one layer's `[slots, ...]`, or with `layer` the whole `[layers, slots, ...]`."""
    return segmented_group(x, [(A, B)], scaling, seg, layer)[0]


def gather(x: jax.Array, A: jax.Array, B: jax.Array, scaling: jax.Array, slots: jax.Array,
           layer: int | None = None) -> jax.Array:
    """`segmented`'s result by a per-token gather (BGMV-style): each row of `x [N, in]` takes its own
    slot's A and B. For benchmarks only: it reads one matrix pair per row, not per slot."""
    dt = _compute_dtype(x, A)
    s = jnp.maximum(slots, 0)
    a = widen(A[s] if layer is None else A[layer, s], dt)  # [N, r, in]
    b = widen(B[s] if layer is None else B[layer, s], dt)  # [N, out, r]
    t = jnp.einsum("ni,nri->nr", x.astype(dt), a)
    return jnp.einsum("nr,nor->no", t, b) * _slot_scale(scaling, slots).astype(dt)[:, None]
