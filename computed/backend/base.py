"""What the model asks of a compute backend: its dense products, its LoRA terms, its decode attention.

A backend is chosen once, when the model loads (`computed.backend.select`), and rides on the
parameters (`DecoderParams.backend`, static under jit); the forward pass (computed/model/decoder.py)
asks it, never the environment. After SGLang's `lora/backend/`: one class per backend, and a
per-batch `prepare` hook that turns a batch's slots into what the backend's LoRA product reads,
once per forward pass, shared by every layer and module.

Backends are frozen dataclasses: hashable, so a backend is part of what jit compiles for, and
their fields are the options the backend owns (a test or a benchmark forces a path by passing
another instance). Every backend gives the same results to float32 rounding.

The seam `Backend`: what may cross it is arrays and static shapes only. From the model: the
activations, the packed weights (`PackedWeight`), the pool's arrays (`LoraPool`) with a
batch's slots, the KV cache; back: arrays of the same dtypes and static shapes, and what
`prepare` made of the batch's slots. No Python value that depends on a traced one, no
replica, residency or serving object crosses it.
after `select`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
    from computed.model.kv_blocks import KVBlocks
    from computed.model.kv_cache import KVCache
    from computed.model.packed import PackedWeight
    from computed.residency.pool import LoraPool


class Backend(ABC):
    """The seam between the model's architecture and the code that computes it."""

    # output columns per panel of packed weights (computed/model/packed.py), or 0: the
    # projections stay [in, out] for XLA's dot
    panel: int = 0

    def panel_for(self, dtype: Any) -> int:
        """Columns per panel to pack a weight of `dtype` in (a bfloat16 one's can differ from float32's:
        AVX2's are 16, computed/backend/kernels/dense.cc), or 0: it stays [in, out] for XLA."""
        return self.panel

    @property
    def blocked(self) -> bool:
        """Whether new KV caches keep K in blocks of positions (the attention kernel's layout)
        rather than positions-minor (XLA's); both layouts are read by XLA's attention."""
        return False

    @abstractmethod
    def matmuls(self, x: jax.Array, ws: Sequence[jax.Array | PackedWeight]) -> list[jax.Array]:
        """x [..., in] @ W for each of `ws`, in x's dtype; products that read one x share a call."""

    @abstractmethod
    def windows(self, batch: int) -> tuple[int | None, ...]:
        """The LoRA windows decode compiles for a batch of `batch` rows (None: no window)."""

    @abstractmethod
    def window(self, slots: np.ndarray, window: int | None) -> int | None:
        """Host side, per decode step: the window for this mix of `slots` (BASE for inactive rows),
        checking a caller's `window` (None: the backend picks). One of `windows(len(slots))` or
        another that fits; ValueError for one that cannot serve this mix."""

    def decode_rows(self, max_batch: int) -> tuple[int, ...]:
        """The entry counts a decode step of a `max_batch`-row cache compiles for, ascending, the
        last `max_batch`: a step runs over the smallest that holds its active rows. Only
        `max_batch` by default (every step computes every row)."""
        return (max_batch,)

    @abstractmethod
    def prepare(self, slots: jax.Array, num_slots: int, window: int | None) -> Any:
        """In the graph, once per forward pass: each row's slot `slots [N]` (BASE for the base model)
        made into what `lora_terms` reads for every layer and module."""

    def prefill_window(self, length: int) -> int | None:
        """The window a prefill of prompts padded to `length` tokens passes `prepare` (each prompt's
        tokens share one slot), or None where the backend has no windows."""
        return None

    @abstractmethod
    def lora_terms(self, x: jax.Array, pool: LoraPool, modules: Sequence[str], batch: Any,
                   layer: int) -> list[jax.Array]:
        """The LoRA terms `[N, out]` of `modules`, which all read `x [N, in]`, each row with its own slot
        (`batch` from `prepare`), from the pool's whole `[layers, slots, ...]` arrays at `layer`."""

    def project(self, x: jax.Array, modules: Sequence[str], weights: Sequence[jax.Array | PackedWeight],
                biases: Mapping[str, jax.Array], pool: LoraPool | None, batch: Any,
                layer: int) -> list[jax.Array]:
        """`x W (+ bias) (+ LoRA)` for each of `modules` (weights in that order), which all read
        `x [..., in]`: their products share a `matmuls` call, their LoRA terms (for the modules the
        pool has) a `lora_terms` call, each row with its own slot (`batch` from `prepare`)."""
        deltas: dict[str, jax.Array] = {}
        present = [] if pool is None else [m for m in modules if m in pool.A]  # all layers: see lora._take
        if pool is not None and present:
            ys = self.lora_terms(x.reshape(-1, x.shape[-1]), pool, present, batch, layer)
            deltas = {m: y.reshape(*x.shape[:-1], -1) for m, y in zip(present, ys)}
        out = []
        for m, y in zip(modules, self.matmuls(x, weights)):
            if m in biases:
                y = y + biases[m]
            d = deltas.get(m)
            out.append(y if d is None else (y + d).astype(x.dtype))
        return out

    def shard_cache(self, cache: KVCache) -> KVCache:
        """`cache` laid out as this backend's decode reads it (a tensor-parallel backend splits it
        over its mesh); in or out of jit."""
        return cache

    def shard_blocks(self, store: KVBlocks) -> KVBlocks:
        """The prefix cache's block store laid out as the KV cache is (split by KV head on a mesh)."""
        return store

    @abstractmethod
    def decode_attention(self, q: jax.Array, k: jax.Array, v: jax.Array, cache: KVCache, layer: int,
                         positions: jax.Array, active: jax.Array, attend_len: int, *,
                         scale: float | None = None, window: int = 0,
                         softcap: float = 0.0) -> tuple[jax.Array, KVCache]:
        """One decode step's attention of `layer`: writes k and v [B, kv, d] at positions[b] of each
        active row b of the cache, and attends q [B, kv, g, d] over [0, positions[b]]. Returns
        (out [B, heads * d] in q's dtype, the updated cache). `attend_len` (static) bounds the
        positions read where the backend reads a bucket of them. The layer's options, static, as
        computed/model/attention.py has them: `scale` (None: head_dim**-0.5), `window` (0: none;
        else over (positions[b] - window, positions[b]]) and `softcap` (0: none)."""

    def attend_len(self, cache: KVCache, attend_len: int) -> int:
        """The `attend_len` decode compiles for, given the caller's (checked) bucket."""
        return attend_len

    def cache_dtype(self, dtype: str | jnp.dtype) -> jnp.dtype:
        """The KV cache's dtype for a model of `dtype`: the model's own, unless the backend's
        attention reads another."""
        return jnp.dtype(dtype)

    def check_cache(self, cache: KVCache) -> None:
        """ValueError where this backend cannot attend over `cache`'s layout or dtype."""
