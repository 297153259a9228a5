"""A slot's digest read in place: the pool's own buffers, where they are host memory.

`MemoryPool.slot_digest` (computed/residency/pool.py) defines the bytes: for each target module in
MODULES order, A over all layers then B, in the pool's storage dtype, then scaling (float32)
and rank (int32). An unsharded pool on the CPU holds them in host memory, so they are
hashed through DLPack views of the buffers themselves, with no copy of the slot (a replica
hashes the slot of every load it applies). The views end inside the caller's `reading()`
block: none outlives it to pin a buffer across a write (a write donating the array would
then copy it whole).

A cleared (or never written) slot is all zero bytes: the pool knows its digest, that of
that many zero bytes (`zeros_digest`, computed once per pool shape), without reading it.
"""
from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterator
from typing import Any, cast

import jax
import numpy as np


def _host(array: jax.Array) -> np.ndarray:
    """The array's host buffer itself, as a numpy array (no copy)."""
    return np.from_dlpack(cast(Any, array))


def _parts(arrays: list[jax.Array], slot: int) -> Iterator[np.ndarray]:
    """`slot`'s C-contiguous blocks of each array, in order: per layer of a [layers, slots,
    ...] array, or the one element of a [slots] array."""
    for array in arrays:
        host = _host(array)
        if host.ndim == 1:
            yield host[slot:slot + 1]
        else:
            for layer in range(host.shape[0]):
                yield np.ascontiguousarray(host[layer, slot])  # contiguous: a view


@functools.lru_cache(maxsize=16)
def zeros_digest(nbytes: int) -> str:
    return hashlib.sha256(bytes(nbytes)).hexdigest()


def slot_digest_in_place(arrays: list[jax.Array], slot: int) -> str:
    """sha256 hex of `slot`'s bytes in `arrays`, in digest order (rank last)."""
    h = hashlib.sha256()
    for part in _parts(arrays, slot):
        h.update(part.data)
    return h.hexdigest()
