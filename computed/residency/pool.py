"""The JAX LoRA memory pool: fixed-shape device arrays with one slot per adapter.

Layout (`LoraPool`), fixed at start from `pool.configured`; one stacked layer
axis per target module keeps the pytree small (2 arrays per module):

    A[module]  [num_layers, slots, max_rank, in_features]   pool dtype
    B[module]  [num_layers, slots, out_features, max_rank]  pool dtype
    scaling    [slots]                                       float32
    rank       [slots]                                       int32

A bfloat16 pool holds its A and B as uint16 arrays of the bfloat16 bit patterns
(`storage_dtype`): XLA on CPU computes bfloat16 array ops in float32, so any slice of a
bfloat16 pool inside the model's window loop made it widen the whole pool array to float32
before the loop, on every step (decode ran 3-4x slower than with a float32 pool).
`lora.widen` turns a slot's bits into float32 exactly. The bytes, and so the digests, are
the bfloat16 bytes either way; `read_slot` returns bfloat16 arrays.

An adapter of rank r occupies A[..., :r, :] and B[..., :r] of its slot; the padding, and
every module or layer the adapter lacks, is zero, so it adds nothing to the LoRA term.

Writes. `write_slot` pads the adapter on the host to fixed shapes and writes, one jitted
call each (computed/residency/pool_ops.py), the modules it has, the modules the slot's last holder had
and it lacks (with read-only zero blocks made with the pool, `_zeros`), and the slot's
scaling and rank; every other module of the slot is zero already (`_held` says which
modules of each slot may not be). Each call donates what it updates; `clear_slot` zeroes
the held modules and the scaling and rank the same way. The slot index is a traced int32,
so after one compile per array shape (made when the pool is), loading any adapter into any
slot never recompiles, and donation makes the update in place: the big buffers are never
reallocated. Keep no numpy view of a pool array (`np.asarray`, `jax.device_get` on CPU are
zero-copy) across a write: while a view is alive, XLA cannot reuse the buffer and the write
silently copies the whole array instead; `read_slot` and `digest` copy or drop their views.

Sharded pools. A tensor-parallel replica passes `shardings` (computed/model/sharding.py): the
arrays are made in place on its mesh, and the writes are jitted with in and out shardings
equal, so each device writes its own part of the slot, still in place and compiled once;
digests read the same bytes in the same order as an unsharded pool's.

In-flight protection (leases with pending writes). An inference request takes
`acquire(slot)` when it is admitted and releases the lease when it finishes.
`write_slot`/`clear_slot` on a slot without readers apply at once and return
True. On a slot with readers they never block: the operation is stored as the slot's
pending write and they return False; a later operation on the same slot replaces it (each
one rewrites the whole slot, so the last one decides the contents). While a write is
pending the slot is draining: `acquire` raises `SlotDraining`, so no new request computes
with contents about to be replaced, and the write is applied by the `release` of the slot's
last reader. Writes to other slots are unaffected.

Threads. One lock guards the arrays, the reader counts and the pending writes, so the sync
loop and the inference loop may run on different threads. A write donates the pool, which
deletes the previous `jax.Array`s, so a thread that reads `arrays` while another may write
must dispatch its computation inside `with pool.reading() as arrays:`; writes wait for the
block to end (a thread's own writes or releases inside its block are applied when it ends).
Dispatch is asynchronous: a write dispatched after a computation that reads the pool waits
for that computation, so it sees the old contents.
"""
from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from computed.residency.pool_ops import plain_ops, sharded_ops, slot_of
from computed.residency.slot_digest import slot_digest_in_place, zeros_digest
from shared.config import POOL_DTYPES
from shared.projections import MODULES


@dataclass(frozen=True)
class PoolSpec:
    """The pool's immutable shape, taken from `pool.configured`."""

    num_layers: int
    module_dims: Mapping[str, tuple[int, int]]  # target module -> (in_features, out_features)
    slots: int  # max_loras
    max_rank: int
    dtype: str  # one of POOL_DTYPES

    def __post_init__(self) -> None:
        for name in ("num_layers", "slots", "max_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"pool {name} must be at least 1, got {getattr(self, name)}")
        if self.dtype not in POOL_DTYPES:
            raise ValueError(f"pool dtype {self.dtype!r} is not one of {', '.join(POOL_DTYPES)}")
        if not self.module_dims:
            raise ValueError("the pool needs at least one target module")
        for module, dims in self.module_dims.items():
            if module not in MODULES:
                raise ValueError(f"unknown target module {module!r}; known: {', '.join(MODULES)}")
            if len(dims) != 2 or min(dims) < 1:
                raise ValueError(f"{module}: dims must be (in_features, out_features) >= 1, got {dims}")

    @property
    def modules(self) -> tuple[str, ...]:
        """The pool's target modules in canonical (MODULES) order."""
        return tuple(m for m in MODULES if m in self.module_dims)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LoraPool:
    """The pool's device arrays (layout in the module docstring)."""

    A: dict[str, jax.Array]
    B: dict[str, jax.Array]
    scaling: jax.Array
    rank: jax.Array


@dataclass(frozen=True)
class SlotWeights:
    """One adapter's host weights: (layer, module) -> (A [rank, in], B [out, rank]), any float
    dtype; the layers and modules the adapter lacks are absent."""

    scaling: float
    rank: int
    pairs: Mapping[tuple[int, str], tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class SlotContents:
    """A host copy of one slot: A [layers, max_rank, in], B [layers, out, max_rank] per module."""

    A: dict[str, np.ndarray]
    B: dict[str, np.ndarray]
    scaling: float
    rank: int


class SlotDraining(RuntimeError):
    """`acquire` on a slot whose pending write waits for its current readers."""


class Lease:
    """A reader's hold on one slot; a context manager that releases it on exit."""

    def __init__(self, pool: MemoryPool, slot: int) -> None:
        self.pool = pool
        self.slot = slot
        self.released = False

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.pool.release(self)


_Op = tuple[Callable[..., LoraPool], tuple[Any, ...]]


def storage_dtype(dtype: str) -> np.dtype:
    """The dtype of a pool's A and B arrays for a pool dtype: bfloat16 as its uint16 bits."""
    return np.dtype(np.uint16) if dtype == "bfloat16" else np.dtype(jnp.dtype(dtype))


class MemoryPool:
    """Owner of the device pool: the only mutable state, changed by its methods.

    `shardings` (a LoraPool of `NamedSharding`s, computed/model/sharding.py `pool_shardings`)
    lays the arrays out on a mesh (a tensor-parallel replica); by default they lie on one device."""

    def __init__(self, spec: PoolSpec, *, shardings: LoraPool | None = None) -> None:
        self.spec = spec
        self.shardings = shardings
        self._ops = plain_ops(spec.modules) if shardings is None else sharded_ops(shardings)
        def zeros() -> LoraPool:
            return cast(LoraPool, jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), self.shapes()))
        # a sharded pool is made in place, never whole on one device
        self._arrays: LoraPool = zeros() if shardings is None else jax.jit(zeros, out_shardings=shardings)()
        self._lock = threading.RLock()
        self._readers = [0] * spec.slots
        self._pending: dict[int, _Op] = {}
        self._reading_depth = 0
        self._cleared = zeros_digest(8 + sum(  # a zeroed slot's digest: its bytes, all zero
            spec.num_layers * spec.max_rank * (i + o) for i, o in spec.module_dims.values())
            * storage_dtype(spec.dtype).itemsize)
        self._slot_digests: list[str | None] = [self._cleared] * spec.slots
        # one read-only zero block per module, for a held module an adapter lacks (host arrays,
        # as the others: a mix of host and device arrays is another jit cache entry)
        self._zeros = self._zero_blocks()
        # the modules of each slot that may hold non-zero bytes (every other one is zero)
        self._held: list[frozenset[str]] = [frozenset()] * spec.slots
        # compile every write now, writing zeros into zeros: none compiles while serving
        self._arrays = self._put(self._arrays, 0, *self._zeros, np.float32(0), np.int32(0))
        self._held[0] = frozenset()
        # the buffers are host memory: digests read them in place (computed/residency/slot_digest.py)
        self._host_memory = shardings is None and self._arrays.rank.devices().pop().platform == "cpu"

    def shapes(self) -> LoraPool:
        """The pool's arrays as shapes and dtypes only (`jax.ShapeDtypeStruct`), from the spec:
        what compiling needs, without the lock or the buffers."""
        spec, dtype = self.spec, storage_dtype(self.spec.dtype)
        lead = (spec.num_layers, spec.slots)

        def abstract(shape: tuple[int, ...], of: Any, sharding: NamedSharding | None = None) -> jax.Array:
            # jit's lower() takes a ShapeDtypeStruct wherever it takes an array
            return cast(jax.Array, jax.ShapeDtypeStruct(shape, of, sharding=sharding))
        def on(get: Callable[[LoraPool], Any]) -> NamedSharding | None:
            return None if self.shardings is None else cast(NamedSharding, get(self.shardings))
        return LoraPool(
            A={m: abstract(lead + (spec.max_rank, i), dtype, on(lambda s: s.A[m])) for m, (i, _) in self._dims()},
            B={m: abstract(lead + (o, spec.max_rank), dtype, on(lambda s: s.B[m])) for m, (_, o) in self._dims()},
            scaling=abstract((spec.slots,), jnp.float32, on(lambda s: s.scaling)),
            rank=abstract((spec.slots,), jnp.int32, on(lambda s: s.rank)),
        )

    def _dims(self) -> list[tuple[str, tuple[int, int]]]:
        return [(m, self.spec.module_dims[m]) for m in self.spec.modules]

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.spec.slots:
            raise IndexError(f"slot {slot} is outside the pool's {self.spec.slots} slots (max_loras)")

    @property
    def arrays(self) -> LoraPool:
        """The current arrays; valid until the next write (see `reading` when threads share the pool)."""
        with self._lock:
            return self._arrays

    @property
    def pending(self) -> frozenset[int]:
        """Slots whose write waits for their readers to release."""
        with self._lock:
            return frozenset(self._pending)

    @contextmanager
    def reading(self) -> Iterator[LoraPool]:
        """Yield the arrays and hold back every write until the block ends; dispatch inside it."""
        with self._lock:
            self._reading_depth += 1
            try:
                yield self._arrays
            finally:
                self._reading_depth -= 1
                self._apply_ready()

    def write_slot(self, slot: int, weights: SlotWeights) -> bool:
        """Load `weights` into `slot`; True if applied now, False if deferred (see the module docstring)."""
        self._check_slot(slot)
        A, B = self._padded(weights)
        return self._submit(slot, (self._put, (slot, A, B, np.float32(weights.scaling),
                                                np.int32(weights.rank))))

    def clear_slot(self, slot: int) -> bool:
        """Zero `slot`; True if applied now, False if deferred (see the module docstring)."""
        self._check_slot(slot)
        return self._submit(slot, (self._zero, (slot,)))

    def busy(self, slot: int) -> bool:
        """True while `slot` has readers or a write that waits for them."""
        with self._lock:
            return self._readers[slot] > 0 or slot in self._pending

    def acquire(self, slot: int) -> Lease:
        """Count a reader of `slot` until the lease is released; refused while a write is pending."""
        self._check_slot(slot)
        with self._lock:
            if slot in self._pending:
                raise SlotDraining(
                    f"slot {slot} has a pending write and takes no new readers until its "
                    f"{self._readers[slot]} current reader(s) release; retry after they finish"
                )
            self._readers[slot] += 1
            return Lease(self, slot)

    def release(self, lease: Lease) -> None:
        """End a lease; the last reader of a slot applies its pending write."""
        with self._lock:
            if lease.released:
                raise RuntimeError(f"the lease on slot {lease.slot} was already released")
            lease.released = True
            self._readers[lease.slot] -= 1
            self._apply_ready()

    def _submit(self, slot: int, op: _Op) -> bool:
        with self._lock:
            self._pending[slot] = op
            self._apply_ready()
            return slot not in self._pending

    def _apply_ready(self) -> None:
        """Apply the pending writes of slots without readers (lock held)."""
        if self._reading_depth:
            return
        for slot in [s for s in self._pending if self._readers[s] == 0]:
            fn, args = self._pending.pop(slot)
            self._arrays = fn(self._arrays, *args)
            # a cleared slot is known to be zero: it is not read again to be hashed
            self._slot_digests[slot] = self._cleared if fn == self._zero else None

    def _zero(self, arrays: LoraPool, slot: int) -> LoraPool:
        return self._put(arrays, slot, {}, {}, np.float32(0), np.int32(0))

    def _put(self, arrays: LoraPool, slot: int, A: dict[str, np.ndarray], B: dict[str, np.ndarray],
             scaling: np.float32, rank: np.int32) -> LoraPool:
        """`arrays` with `slot` holding modules `A` and `B` (host arrays of one slot's shapes),
        `scaling` and `rank`, and zero in every other module (lock held)."""
        zA, zB = self._zeros
        newA, newB, at = dict(arrays.A), dict(arrays.B), np.int32(slot)
        for m in self.spec.modules:
            if m in A or m in self._held[slot]:
                newA[m], newB[m] = self._ops.module[m](newA[m], newB[m], at, A.get(m, zA[m]),
                                                       B.get(m, zB[m]))
        scalings, ranks = self._ops.meta(arrays.scaling, arrays.rank, at, scaling, rank)
        self._held[slot] = frozenset(A)
        return LoraPool(A=newA, B=newB, scaling=scalings, rank=ranks)

    def _padded(self, weights: SlotWeights) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Host arrays of the pool's per-slot shapes for the modules `weights` has, zero in the
        layers and ranks it lacks."""
        spec, r = self.spec, weights.rank
        if r < 1:
            raise ValueError(f"adapter has rank {r}; a LoRA rank is at least 1")
        if r > spec.max_rank:
            raise ValueError(f"adapter has rank {r}, above the pool's max_rank {spec.max_rank}; "
                             "configure the pool with a larger max_rank")
        A, B = self._blocks(jnp.dtype(spec.dtype), {module for _, module in weights.pairs})
        for (layer, module), (a, b) in weights.pairs.items():
            if module not in spec.module_dims:
                raise ValueError(f"adapter targets {module}, which is not a target module of this pool "
                                 f"({', '.join(spec.modules)})")
            if not 0 <= layer < spec.num_layers:
                raise ValueError(
                    f"adapter has {module} at layer {layer}; the model has {spec.num_layers} layers"
                )
            i, o = spec.module_dims[module]
            if a.shape != (r, i) or b.shape != (o, r):
                raise ValueError(f"layer {layer} {module}: A {a.shape} and B {b.shape} do not match "
                                 f"(rank, in_features) = {(r, i)} and (out_features, rank) = {(o, r)}")
            A[module][layer, :r] = a
            B[module][layer, :, :r] = b
        stored = storage_dtype(spec.dtype)
        return ({m: a.view(stored) for m, a in A.items()}, {m: b.view(stored) for m, b in B.items()})

    def _blocks(self, dtype: Any, modules: Collection[str],
                ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Zero host arrays of one slot's shapes for `modules`: A [layers, max_rank, in] and
        B [layers, out, max_rank]."""
        spec = self.spec
        return ({m: np.zeros((spec.num_layers, spec.max_rank, i), dtype)
                 for m, (i, _) in self._dims() if m in modules},
                {m: np.zeros((spec.num_layers, o, spec.max_rank), dtype)
                 for m, (_, o) in self._dims() if m in modules})

    def _zero_blocks(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        zA, zB = self._blocks(storage_dtype(self.spec.dtype), self.spec.module_dims)
        for block in (*zA.values(), *zB.values()):
            block.setflags(write=False)
        return zA, zB

    def read_slot(self, slot: int) -> SlotContents:
        """A host copy of `slot`, extracted on the device (one compile for every slot)."""
        self._check_slot(slot)
        with self.reading() as pool:
            A, B, scaling, rank = jax.device_get(slot_of(pool, np.int32(slot)))
        dtype = jnp.dtype(self.spec.dtype)  # a bfloat16 pool's uint16 bits, viewed as bfloat16
        return SlotContents(A={m: np.asarray(a).view(dtype) for m, a in A.items()},
                            B={m: np.asarray(b).view(dtype) for m, b in B.items()},
                            scaling=float(scaling), rank=int(rank))

    def slot_digest(self, slot: int) -> str:
        """sha256 hex of one slot's bytes: for each target module in MODULES order, A over
        all layers ([num_layers, max_rank, in], C order) then B ([num_layers, out,
        max_rank]), in the pool dtype; then scaling (float32) and rank (int32);
        little-endian. Cached until the slot is next written; a cleared slot's is known
        without reading it. An unsharded pool on the CPU is read in place
        (computed/residency/slot_digest.py)."""
        with self._lock:
            cached = self._slot_digests[slot]
            if cached is None:
                if self._host_memory:
                    with self.reading() as pool:
                        arrays = [a for m in self.spec.modules for a in (pool.A[m], pool.B[m])]
                        cached = slot_digest_in_place([*arrays, pool.scaling, pool.rank], slot)
                else:
                    c, h = self.read_slot(slot), hashlib.sha256()
                    for m in self.spec.modules:
                        h.update(c.A[m].tobytes() + c.B[m].tobytes())
                    h.update(np.float32(c.scaling).tobytes() + np.int32(c.rank).tobytes())
                    cached = h.hexdigest()
                self._slot_digests[slot] = cached
            return cached

    def slot_digests(self) -> list[str]:
        """Every slot's `slot_digest`, in slot order."""
        with self._lock:  # cached ones as they are: status asks for all of them each time
            return [d or self.slot_digest(s) for s, d in enumerate(self._slot_digests)]

    def digest(self) -> str:
        """The pool digest: sha256 over the slot digests (`slot_digest`) of slot 0, 1, ...,
        each as 32 raw bytes. Equal contents give equal digests whatever the history;
        after a diff only the slots it wrote are hashed again."""
        return hashlib.sha256(b"".join(map(bytes.fromhex, self.slot_digests()))).hexdigest()
