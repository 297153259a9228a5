"""The native backend: the CPU kernels built from computed/backend/kernels (docs/kernels.md).

- LoRA: `sgmv.cc` (`lora_sgmv`). Rows stay in batch order; the kernel groups them by slot and
  reads each slot's A and B once, in place in the pool, stopping at the slot's own rank. XLA's
  window loop copies them out of the pool for every window instead. Any mix of slots runs
  in one compile.
- Dense products: `dense.cc` (`dense_matmuls`), on an AVX-512 or AVX2+FMA CPU, over weights packed
  into column panels once at load (computed/model/packed.py `PackedWeight`; float32, or a bfloat16
  model's bits, widened in registers): the kernel streams each weight once per decode step, where
  XLA's dot repacks it on every call. Weights left [in, out] (neither AVX-512 nor AVX2+FMA) go to
  XLA's dot.
- Decode attention: `attention.cc` (`attention_kernel`), each row over its own positions of a
  float32 cache with K in blocks (a bfloat16 model's too: `cache_dtype`), in place (a sliding
  window's last positions only); one compile serves every length.

This is the only module that imports the kernels' build (computed/backend/kernels).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from computed.backend import kernels
from computed.backend.base import Backend
from computed.backend.xla import lora_gather
from computed.model import attention
from computed.model.kv_cache import KVCache
from computed.model.packed import PackedWeight
from computed.residency.pool import LoraPool

LORA_IMPLS = ("sgmv", "gather")
ATTENTION_IMPLS = ("kernel", "xla")


def available() -> bool:
    """Whether the kernels are built, loaded and registered for this process's backend."""
    return kernels.available()


def unavailable_reason() -> str | None:
    """Why the kernels cannot be used here (LORAPLANE_LORA_KERNEL=xla, no compiler, ...), or None."""
    return kernels.unavailable_reason()


def dense_panel(bfloat16: bool = False) -> int:
    """The dense kernel's panel width here for float32 (or bfloat16) weights, or 0 where it cannot run (no
    kernels, neither AVX-512 nor AVX2+FMA)."""
    return kernels.dense_panel(bfloat16)


def lora_sgmv(x: jax.Array, pairs: Sequence[tuple[jax.Array, jax.Array]], scaling: jax.Array,
              rank: jax.Array, slots: jax.Array, layer: int) -> list[jax.Array]:
    """`lora.segmented_group`'s terms from the SGMV kernel (computed/backend/kernels/sgmv.cc), rows in batch
    order: `[N, out]` float32 per (A, B) pair, A and B the whole `[layers, slots, ...]` pool arrays
    of one dtype (float32, or a bfloat16 pool's uint16 bits), `rank [slots]` each slot's rank.

    The kernels must be available (`available()`); the terms are computed in float32."""
    kernels.require()
    outs = [jax.ShapeDtypeStruct((x.shape[0], B.shape[-2]), jnp.float32) for _, B in pairs]
    operands = [m for pair in pairs for m in pair]
    return list(jax.ffi.ffi_call(kernels.SGMV, outs)(
        x.astype(jnp.float32), slots.astype(jnp.int32), scaling.astype(jnp.float32), rank.astype(jnp.int32),
        *operands, layer=np.int64(layer)))


def dense_matmuls(x: jax.Array, ws: Sequence[jax.Array | PackedWeight]) -> list[jax.Array]:
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


def attention_kernel(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, lengths: jax.Array, k: jax.Array,
                     v: jax.Array, layer: int, scale: float, *, window: int = 0,
                     softcap: float = 0.0) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One decode step's attention of layer `layer` by the native kernel (computed/backend/kernels/attention.cc):
    writes `k` and `v` [B, kv, d] at position lengths[b] - 1 of row b of the caches (rows with
    length 0 write nothing), then attends q [B, kv, g, d] over each row's first lengths[b]
    positions (its last `window` of them where `window` is set; scores soft-capped where `softcap`
    is: computed/model/attention.py), read in place. Returns (out [B, kv, g, d] float32, k_cache,
    v_cache); the caches are updated in place (the kernel's results alias them)."""
    attention.check_options(window, softcap)
    kernels.require()
    shapes = (jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
              jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype))
    call = jax.ffi.ffi_call(kernels.ATTENTION, shapes, input_output_aliases={1: 1, 2: 2})
    out, k_cache, v_cache = call(q.astype(jnp.float32), k_cache, v_cache, lengths, k.astype(jnp.float32),
                                 v.astype(jnp.float32), layer=np.int64(layer), scale=np.float32(scale),
                                 window=np.int64(window), softcap=np.float32(softcap))
    return out, k_cache, v_cache


@dataclass(frozen=True)
class NativeBackend(Backend):
    """The CPU kernels; constructing one builds (or finds) and loads them, KernelError where they
    cannot be. Options, for tests and benchmarks that force a path:

    - `panel`: the dense kernel's panel width to pack weights in (default: this CPU's, 0 without
      AVX-512 or AVX2+FMA); 0 keeps weights [in, out] for XLA's dot.
    - `attention`: "kernel" (a float32 cache with K in blocks, whatever the model's dtype), or
      "xla" over a length bucket (a cache in the model's dtype, either layout, for comparisons).
    - `lora`: "sgmv", or "gather" (the per-token gather, for benchmarks only)."""

    panel: int = field(default_factory=dense_panel)
    attention: str = "kernel"
    lora: str = "sgmv"

    def __post_init__(self) -> None:
        kernels.require()
        if self.lora not in LORA_IMPLS:
            raise ValueError(f"NativeBackend's lora must be one of {', '.join(LORA_IMPLS)}, got {self.lora!r}")
        if self.attention not in ATTENTION_IMPLS:
            raise ValueError(f"NativeBackend's attention must be one of {', '.join(ATTENTION_IMPLS)}, "
                             f"got {self.attention!r}")
        if self.panel not in (0, dense_panel()):
            raise ValueError(f"panel {self.panel}: the dense kernel here packs {dense_panel()} columns "
                             "(0: neither AVX-512 nor AVX2+FMA), or pass 0 to keep weights [in, out]")

    @property
    def blocked(self) -> bool:
        return self.attention == "kernel"

    def panel_for(self, dtype: Any) -> int:
        if not self.panel:
            return 0
        return dense_panel(bfloat16=True) if jnp.dtype(dtype) == jnp.bfloat16 else self.panel

    def matmuls(self, x: jax.Array, ws: Sequence[jax.Array | PackedWeight]) -> list[jax.Array]:
        return dense_matmuls(x, ws)

    def windows(self, batch: int) -> tuple[int | None, ...]:
        return (None,)

    def window(self, slots: np.ndarray, window: int | None) -> int | None:
        if window is not None and self.lora == "sgmv":
            raise ValueError(f"window {window}: the native LoRA kernel takes any mix without one "
                             "(windows are the XLA backend's window loop)")
        return None

    def decode_rows(self, max_batch: int) -> tuple[int, ...]:
        # quarters of the batch: a step of 5 running requests in a 32-row cache computes 8 rows,
        # not 32 (the dense kernel costs about its rows once they outweigh streaming the weights).
        # Below 8 rows streaming the weights is the whole cost: one compile, every row.
        if max_batch < 8:
            return (max_batch,)
        return tuple(sorted({-(-max_batch * i // 4) for i in range(1, 5)}))

    def prepare(self, slots: jax.Array, num_slots: int, window: int | None) -> Any:
        return slots

    def lora_terms(self, x: jax.Array, pool: LoraPool, modules: Sequence[str], batch: Any,
                   layer: int) -> list[jax.Array]:
        if self.lora == "gather":
            return lora_gather(x, pool, modules, batch, layer)
        return lora_sgmv(x, [(pool.A[m], pool.B[m]) for m in modules], pool.scaling, pool.rank, batch, layer)

    def decode_attention(self, q: jax.Array, k: jax.Array, v: jax.Array, cache: KVCache, layer: int,
                         positions: jax.Array, active: jax.Array, attend_len: int, *,
                         scale: float | None = None, window: int = 0,
                         softcap: float = 0.0) -> tuple[jax.Array, KVCache]:
        if self.attention == "xla":
            return attention.bucket(q, k, v, cache, layer, positions, active, attend_len, scale=scale,
                                    window=window, softcap=softcap)
        lengths = jnp.where(active, positions + 1, 0).astype(jnp.int32)
        out, k_cache, v_cache = attention_kernel(q, cache.k, cache.v, lengths, k, v, layer,
                                                 q.shape[-1] ** -0.5 if scale is None else scale,
                                                 window=window, softcap=softcap)
        return out.astype(q.dtype).reshape(q.shape[0], -1), KVCache(k_cache, v_cache)

    def attend_len(self, cache: KVCache, attend_len: int) -> int:
        # unused by the kernel: one compile for every length
        return cache.max_len if self.attention == "kernel" else attend_len

    def cache_dtype(self, dtype: str | jnp.dtype) -> jnp.dtype:
        # the attention kernel's cache is float32; a bfloat16 model's K and V are bfloat16 values,
        # which it holds exactly (docs/kernels.md, bfloat16 models)
        return jnp.dtype(jnp.float32) if self.attention == "kernel" else jnp.dtype(dtype)

    def check_cache(self, cache: KVCache) -> None:
        if self.attention == "kernel" and not (cache.blocked and cache.k.dtype == jnp.float32):
            raise ValueError("the attention kernel needs a float32 cache with K in blocks: init_cache(..., "
                             "blocked=True), or NativeBackend(attention='xla')")
