"""The portable backend: XLA alone, on any JAX device.

Projections are XLA's dot over weights kept `[in, out]`; the LoRA terms of a batch that mixes
slots come from the window loop (computed/model/lora.py `segmented_group`, one compile per window,
each step's window chosen from its mix by `lora.choose_window`); decode attends over the
smallest length bucket that holds the longest running sequence (computed/model/attention.py
`bucket`), on either layout of K. It is what a replica runs where the native kernels cannot be
built (no compiler, another device, `LORAPLANE_LORA_KERNEL=xla`).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from computed.model import lora
from computed.backend.base import Backend
from computed.model import attention
from computed.model.kv_cache import KVCache
from computed.model.packed import PackedWeight
from computed.residency.pool import LoraPool

LORA_IMPLS = ("segmented", "gather")


def lora_gather(x: jax.Array, pool: LoraPool, modules: Sequence[str], slots: jax.Array,
                layer: int) -> list[jax.Array]:
    """The per-token gather's terms (BGMV-style: every row gathers its own slot's A and B), for
    benchmarks only; serving never uses it."""
    return [lora.gather(x, pool.A[m], pool.B[m], pool.scaling, slots, layer) for m in modules]


@dataclass(frozen=True)
class XlaBackend(Backend):
    """XLA's dot, the LoRA window loop and bucket attention. `lora` "gather" swaps the per-token
    gather in for the window loop (benchmarks only)."""

    lora: str = "segmented"

    def __post_init__(self) -> None:
        if self.lora not in LORA_IMPLS:
            raise ValueError(f"XlaBackend's lora must be one of {', '.join(LORA_IMPLS)}, got {self.lora!r}")

    def matmuls(self, x: jax.Array, ws: Sequence[jax.Array | PackedWeight]) -> list[jax.Array]:
        out = []
        for w in ws:
            if isinstance(w, PackedWeight):
                raise ValueError("packed weights need the native backend: lay the model out for this one "
                                 "(computed.model.loader.with_layout)")
            out.append(x @ w)
        return out

    def windows(self, batch: int) -> tuple[int | None, ...]:
        return (None,) if self.lora == "gather" else lora.loop_windows(batch)

    def window(self, slots: np.ndarray, window: int | None) -> int | None:
        b = len(slots)
        if self.lora == "gather":
            return None  # unused: one compile whatever the caller passed
        if window is None:
            return lora.choose_window(slots, lora.loop_windows(b))
        if not 1 <= window <= b or lora.padded_rows(slots, window) > 2 * b:
            raise ValueError(f"window {window} does not fit this mix of slots in {2 * b} rows (twice max_batch); "
                             "leave window unset to have lora.choose_window pick one")
        return window

    def prefill_window(self, length: int) -> int | None:
        # a prompt's tokens fill whole windows of its own slot: one window per prompt, no padding
        return None if self.lora == "gather" else length

    def prepare(self, slots: jax.Array, num_slots: int, window: int | None) -> Any:
        if self.lora == "gather":
            return slots
        if window is None:
            return lora.segments(slots, num_slots)
        return lora.segments(slots, num_slots, window=window, rows=2 * slots.shape[0])

    def lora_terms(self, x: jax.Array, pool: LoraPool, modules: Sequence[str], batch: Any,
                   layer: int) -> list[jax.Array]:
        if self.lora == "gather":
            return lora_gather(x, pool, modules, batch, layer)
        return lora.segmented_group(x, [(pool.A[m], pool.B[m]) for m in modules], pool.scaling, batch, layer)

    def decode_attention(self, q: jax.Array, k: jax.Array, v: jax.Array, cache: KVCache, layer: int,
                         positions: jax.Array, active: jax.Array, attend_len: int, *,
                         scale: float | None = None, window: int = 0,
                         softcap: float = 0.0) -> tuple[jax.Array, KVCache]:
        return attention.bucket(q, k, v, cache, layer, positions, active, attend_len, scale=scale, window=window,
                                softcap=softcap)
