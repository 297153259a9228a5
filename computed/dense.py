"""The model's dense products `x W`: XLA's dot, or the native kernel over packed weights.

A float32 model whose replica has the native kernels on an AVX-512 CPU keeps
every projection weight and the lm_head packed, once, at load time (a tied
model's packed lm_head is then its embedding's only copy):
`[panels, in, panel]`, each panel `panel` consecutive output columns whose
`in` rows lie one after another, the last panel zero-padded. The dense kernel
(computed/kernels/dense.cc) streams that layout exactly once per product,
which is what a decode step wants: few rows, weights too large for the cache,
read once per step. XLA's dot packs W into blocks on every call instead.
Everywhere else (bfloat16 models, no compiler, no AVX-512,
`LORAPLANE_LORA_KERNEL=xla`, another backend) weights stay `[in, out]` and XLA
multiplies them; both give the same results to float32 rounding (tested).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from computed import kernels

@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PackedWeight:
    """W [in, out] packed for the dense kernel: `panels [ceil(out / panel), in, panel]` float32."""

    panels: jax.Array
    out: int = field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int]:
        """W's logical shape [in, out]."""
        return int(self.panels.shape[1]), self.out


def pack(w: np.ndarray | jax.Array, panel: int) -> PackedWeight:
    """W [in, out] float32 -> its panels (host work, once per weight)."""
    w = np.asarray(w, np.float32)
    n_in, out = w.shape
    count = -(-out // panel)
    padded = np.zeros((n_in, count * panel), np.float32)
    padded[:, :out] = w
    return PackedWeight(jnp.asarray(np.ascontiguousarray(padded.reshape(n_in, count, panel).transpose(1, 0, 2))),
                        out)


def unpack(w: PackedWeight) -> jax.Array:
    """The panels back to W [in, out]."""
    panels = np.asarray(w.panels)
    n_in = panels.shape[1]
    return jnp.asarray(np.ascontiguousarray(panels.transpose(1, 0, 2).reshape(n_in, -1)[:, :w.out]))


def packing_panel(dtype: jnp.dtype | str) -> int:
    """Panel width to pack a model of `dtype` with here, or 0 to keep weights [in, out] for XLA."""
    return kernels.dense_panel() if jnp.dtype(dtype) == jnp.float32 else 0


def matmul(x: jax.Array, w: jax.Array | PackedWeight) -> jax.Array:
    """x [..., in] @ W: the dense kernel for a packed weight, XLA's dot for the others."""
    return matmuls(x, [w])[0]


def matmuls(x: jax.Array, ws: Sequence[jax.Array | PackedWeight]) -> list[jax.Array]:
    """x [..., in] @ W for each of `ws`: packed weights share one call of the dense kernel (one
    transpose of x, one wake-up of the threads), the others go to XLA's dot."""
    packed = [w for w in ws if isinstance(w, PackedWeight)]
    lead, n_in = x.shape[:-1], x.shape[-1]
    ys: list[jax.Array] = []
    if packed:
        rows = int(np.prod(lead))
        call = jax.ffi.ffi_call(kernels.DENSE, [jax.ShapeDtypeStruct((rows, w.out), jnp.float32) for w in packed])
        ys = list(call(x.reshape(rows, n_in).astype(jnp.float32), *(w.panels for w in packed)))
    it = iter(ys)
    return [next(it).reshape(*lead, w.out).astype(x.dtype) if isinstance(w, PackedWeight) else x @ w for w in ws]
