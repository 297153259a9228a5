"""Weights packed for the native dense kernel (`PackedWeight`), and packing them (`pack`, `pack_rows`,
`unpack`).

A room below both sides of the backend seam: the parameters (computed/model/params.py) hold packed
weights, and the backends (computed/backend/) read them, so neither imports the other for it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["PackedWeight", "pack", "pack_rows", "unpack"]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PackedWeight:
    """W [in, out] packed for the dense kernel, in panels of `panel` consecutive output columns (the
    last zero-padded):

    - float32: `panels [ceil(out / panel), in, panel]`, each panel's `in` rows one after another;
    - bfloat16: `panels [ceil(out / panel), ceil(in / 2), panel, 2]` uint16, the bfloat16 bit
      patterns (as a bfloat16 pool holds its weights, computed/residency/pool.py), each column's two
      consecutive k side by side (zero past `in`): the pairs VDPBF16PS multiplies, and XLA never
      sees a bfloat16 array it would widen whole.

    The dense kernel (computed/backend/kernels/dense.cc) streams that layout exactly once per
    product, which is what a decode step wants (few rows, weights too large for the cache); XLA's
    dot packs W into blocks on every call instead."""

    panels: jax.Array
    out: int = field(metadata=dict(static=True))
    n_in: int = field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int]:
        """W's logical shape [in, out]."""
        return self.n_in, self.out

    @property
    def panel(self) -> int:
        """Output columns per panel."""
        return int(self.panels.shape[2])

    @property
    def dtype(self) -> jnp.dtype:
        """W's dtype: float32, or bfloat16 for panels of its bits."""
        return jnp.dtype(jnp.bfloat16) if self.panels.dtype == jnp.uint16 else self.panels.dtype

    def columns(self, cols: jax.Array) -> jax.Array:
        """W[:, cols] as rows `[*cols.shape, in]` in W's dtype, in the graph (a tied model's embeddings)."""
        width = self.panel
        got = self.panels[cols // width, :, cols % width]  # [*cols, in] or bfloat16 [*cols, in2, 2]
        if self.panels.dtype != jnp.uint16:
            return got
        got = got.reshape(*cols.shape, -1)[..., :self.n_in]
        return jax.lax.bitcast_convert_type(got, jnp.bfloat16)


def pack(w: np.ndarray | jax.Array, panel: int) -> PackedWeight:
    """W [in, out] -> its panels (host work, once per weight): a bfloat16 W as its uint16 bits in
    pairs of k, any other as float32."""
    return pack_rows(np.asarray(w).T, panel)


def pack_rows(wt: np.ndarray, panel: int) -> PackedWeight:
    """W's transpose `wt [out, in]` (a checkpoint's own layout, HF's `[out, in]`) -> W's panels:
    panel p, k, column c is wt[p * panel + c, k], so the panels are wt in blocks of `panel` rows,
    each block transposed: one strided copy (through W [in, out] it took a transpose, a padded
    copy and a second transpose: 3.7 s of a Qwen2.5-0.5B load's 7)."""
    wt = np.asarray(wt)
    bf16 = wt.dtype == jnp.bfloat16
    if not bf16:
        wt = wt.astype(np.float32, copy=False)
    out, n_in = wt.shape
    count = -(-out // panel)
    cols = n_in + (n_in % 2 if bf16 else 0)
    if (count * panel, cols) != (out, n_in):
        wt = np.pad(wt, ((0, count * panel - out), (0, cols - n_in)))
    panels: np.ndarray
    if bf16:  # [count, panel, in2] pairs -> [count, in2, panel] pairs: each pair moved as one
        # 32-bit element (3x faster than as two 16-bit ones), then seen as [.., panel, 2] bits
        rows = np.ascontiguousarray(wt).view(np.uint32).reshape(count, panel, cols // 2)
        pairs = np.ascontiguousarray(rows.transpose(0, 2, 1))
        panels = pairs.view(np.uint16).reshape(count, cols // 2, panel, 2)
    else:  # [count, panel, in] -> [count, in, panel]
        panels = np.ascontiguousarray(wt.reshape(count, panel, n_in).transpose(0, 2, 1))
    return PackedWeight(jnp.asarray(panels), out, n_in)


def unpack(w: PackedWeight) -> jax.Array:
    """The panels back to W [in, out], in W's dtype."""
    panels = np.asarray(w.panels)
    if panels.dtype == np.uint16:  # [count, in2, panel, 2] -> [in2, 2, count, panel]
        full = panels.transpose(1, 3, 0, 2).reshape(-1, panels.shape[0] * panels.shape[2]).view(jnp.bfloat16)
    else:
        full = panels.transpose(1, 0, 2).reshape(panels.shape[1], -1)
    return jnp.asarray(np.ascontiguousarray(full[:w.n_in, :w.out]))
