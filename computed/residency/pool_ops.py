"""The pool's jitted slot operations (computed/residency/pool.py): per-module writes and a slot's read.

A slot write updates only what changes: the modules the adapter has, the modules the slot's
last holder had and this one lacks (written with zeros) and the slot's scaling and rank,
each module with `put_module`, which donates that module's A and B. Every other module of
the slot is zero already. A q+v adapter in a pool of all seven modules moves 2 modules' bytes,
not 7: on the bench model (float32, rank 8) an idle write went from 1.9 ms (p99 4.3 ms) for
the whole slot to 0.64 ms (p99 1.5 ms), and a fill's slot write is what sits on the decode
step's path (docs/residency.md).

The slot index is a traced int32, so each operation compiles once per array shape (the pool
compiles them all when it is made); loading any adapter into any slot never recompiles.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

import jax
from jax.sharding import NamedSharding, PartitionSpec

Arrays = tuple[jax.Array, jax.Array]


def _put(buf: jax.Array, value: jax.Array, slot: jax.Array, axis: int) -> jax.Array:
    out: jax.Array = jax.lax.dynamic_update_index_in_dim(buf, value, slot, axis)
    return out


@partial(jax.jit, donate_argnums=(0, 1))
def put_module(a: jax.Array, b: jax.Array, slot: jax.Array, new_a: jax.Array,
               new_b: jax.Array) -> Arrays:
    """One module's A [layers, slots, max_rank, in] and B [layers, slots, out, max_rank] with
    `slot` replaced by `new_a` [layers, max_rank, in] and `new_b`, in place."""
    return _put(a, new_a, slot, 1), _put(b, new_b, slot, 1)


@partial(jax.jit, donate_argnums=(0, 1))
def put_meta(scaling: jax.Array, rank: jax.Array, slot: jax.Array, new_scaling: jax.Array,
             new_rank: jax.Array) -> Arrays:
    """The pool's scaling [slots] and rank [slots] with `slot`'s replaced, in place."""
    return _put(scaling, new_scaling, slot, 0), _put(rank, new_rank, slot, 0)


@jax.jit
def slot_of(pool: Any, slot: jax.Array) -> tuple[dict[str, jax.Array], dict[str, jax.Array],
                                                 jax.Array, jax.Array]:
    """One slot's arrays (A, B per module over all layers, scaling, rank) of a LoraPool,
    slot traced."""
    def take(buf: jax.Array, axis: int) -> jax.Array:
        out: jax.Array = jax.lax.dynamic_index_in_dim(buf, slot, axis, keepdims=False)
        return out
    return ({m: take(a, 1) for m, a in pool.A.items()}, {m: take(b, 1) for m, b in pool.B.items()},
            take(pool.scaling, 0), take(pool.rank, 0))


@dataclass(frozen=True)
class SlotOps:
    """The write operations of one pool: `module[m](A, B, slot, new_A, new_B)` and
    `meta(scaling, rank, slot, new_scaling, new_rank)`."""

    module: dict[str, Callable[..., Arrays]]
    meta: Callable[..., Arrays]


def plain_ops(modules: tuple[str, ...]) -> SlotOps:
    """The operations of a pool on one device."""
    return SlotOps({m: put_module for m in modules}, put_meta)


def _without_slot_axis(sharding: NamedSharding) -> NamedSharding:
    """A pool array's sharding for one slot's update (its slot axis, axis 1, dropped)."""
    spec = tuple(sharding.spec)
    return NamedSharding(sharding.mesh, PartitionSpec(*spec[:1], *spec[2:]))


def sharded_ops(shardings: Any) -> SlotOps:
    """The operations of a pool laid out by `shardings` (a LoraPool of NamedShardings): each
    device writes its own part of the slot in place (in and out shardings equal, the arrays
    donated); the host arrays of the update go to each device as its part only."""
    whole = NamedSharding(cast(NamedSharding, shardings.rank).mesh, PartitionSpec())

    def module(a: NamedSharding, b: NamedSharding) -> Callable[..., Arrays]:
        return jax.jit(put_module.__wrapped__, donate_argnums=(0, 1),  # type: ignore[attr-defined]
                       in_shardings=(a, b, whole, _without_slot_axis(a), _without_slot_axis(b)),
                       out_shardings=(a, b))
    meta = jax.jit(put_meta.__wrapped__, donate_argnums=(0, 1),  # type: ignore[attr-defined]
                   in_shardings=(shardings.scaling, shardings.rank, whole, whole, whole),
                   out_shardings=(shardings.scaling, shardings.rank))
    return SlotOps({m: module(s, shardings.B[m]) for m, s in shardings.A.items()}, meta)
