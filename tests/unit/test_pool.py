"""The JAX LoRA memory pool: contents, digest, in-place writes without recompiles, bf16, leases."""
from __future__ import annotations

import hashlib
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest


from computed.residency.pool import MemoryPool, PoolSpec, SlotDraining, SlotWeights
from computed.residency.pool_ops import put_meta, put_module
from testkit.jaxcount import BACKEND_COMPILE, buffer_pointers, counting_compiles

# Dict order differs from MODULES order on purpose: the pool must not depend on it.
DIMS = {"v_proj": (32, 16), "q_proj": (32, 32), "down_proj": (48, 32)}
SPEC = PoolSpec(num_layers=2, module_dims=DIMS, slots=4, max_rank=8, dtype="float32")


def adapter(
    seed: int,
    rank: int,
    *,
    spec: PoolSpec = SPEC,
    modules: tuple[str, ...] | None = None,
    dtype: type = np.float32,
) -> SlotWeights:
    """Random weights for the given modules (default: all of the pool's) on every layer."""
    rng = np.random.default_rng(seed)
    pairs = {
        (layer, m): (
            rng.standard_normal((rank, spec.module_dims[m][0])).astype(dtype),
            rng.standard_normal((spec.module_dims[m][1], rank)).astype(dtype),
        )
        for layer in range(spec.num_layers)
        for m in (modules or spec.modules)
    }
    return SlotWeights(scaling=float(rng.uniform(0.5, 4.0)), rank=rank, pairs=pairs)


def assert_slot(pool: MemoryPool, slot: int, w: SlotWeights | None) -> None:
    """`slot` holds `w` padded with zeros (or is all zero for None)."""
    got = pool.read_slot(slot)
    spec = pool.spec
    for m in spec.modules:
        i, o = spec.module_dims[m]
        A = np.zeros((spec.num_layers, spec.max_rank, i), np.float32)
        B = np.zeros((spec.num_layers, o, spec.max_rank), np.float32)
        for (layer, module), (a, b) in (w.pairs.items() if w else ()):
            if module == m:
                A[layer, : w.rank] = a
                B[layer, :, : w.rank] = b
        np.testing.assert_array_equal(got.A[m], A)
        np.testing.assert_array_equal(got.B[m], B)
    assert got.scaling == (np.float32(w.scaling) if w else 0.0)
    assert got.rank == (w.rank if w else 0)


def test_write_read_clear() -> None:
    pool = MemoryPool(SPEC)
    base = adapter(1, 3, modules=("q_proj", "v_proj"), dtype=np.float16)
    no_v1 = {key: pair for key, pair in base.pairs.items() if key != (1, "v_proj")}
    partial_adapter = SlotWeights(scaling=base.scaling, rank=base.rank, pairs=no_v1)
    full = adapter(2, 8)
    assert pool.write_slot(1, partial_adapter)
    assert pool.write_slot(2, full)
    assert_slot(pool, 1, partial_adapter)
    assert_slot(pool, 2, full)
    for untouched in (0, 3):
        assert_slot(pool, untouched, None)
    # Overwriting with a smaller adapter leaves no trace of the larger one.
    assert pool.write_slot(2, adapter(3, 2, modules=("down_proj",)))
    assert_slot(pool, 2, adapter(3, 2, modules=("down_proj",)))
    assert pool.clear_slot(1)
    assert_slot(pool, 1, None)
    assert_slot(pool, 2, adapter(3, 2, modules=("down_proj",)))


@pytest.mark.parametrize(
    ("slot", "weights", "message"),
    [
        (4, adapter(0, 2), "outside the pool's 4 slots"),
        (0, adapter(0, 9, spec=PoolSpec(2, DIMS, 4, 16, "float32")), "above the pool's max_rank 8"),
        (0, adapter(0, 2, spec=PoolSpec(2, {"k_proj": (32, 32)}, 4, 8, "float32")), "not a target module"),
        (0, adapter(0, 2, spec=PoolSpec(3, DIMS, 4, 8, "float32")), "the model has 2 layers"),
        (0, adapter(0, 2, spec=PoolSpec(2, {"q_proj": (32, 16)}, 4, 8, "float32")), "do not match"),
    ],
)
def test_write_rejects_what_does_not_fit(slot: int, weights: SlotWeights, message: str) -> None:
    pool = MemoryPool(SPEC)
    with pytest.raises((ValueError, IndexError), match=message):
        pool.write_slot(slot, weights)
    assert pool.digest() == MemoryPool(SPEC).digest()


def test_digest_depends_on_contents_not_history() -> None:
    a, b, c = adapter(1, 4), adapter(2, 8, modules=("q_proj",)), adapter(3, 1)
    direct = MemoryPool(SPEC)
    direct.write_slot(0, a)
    direct.write_slot(1, b)
    winding = MemoryPool(SPEC)
    winding.write_slot(2, b)
    winding.write_slot(0, c)
    winding.write_slot(1, b)
    winding.clear_slot(2)
    winding.write_slot(0, a)
    assert winding.digest() == direct.digest()
    assert direct.digest() != MemoryPool(SPEC).digest()

    one_value = adapter(1, 4)
    one_value.pairs[(1, "down_proj")][1][5, 2] += 0.25
    winding.write_slot(0, one_value)
    assert winding.digest() != direct.digest()
    other_scaling = SlotWeights(scaling=a.scaling + 1.0, rank=a.rank, pairs=a.pairs)
    winding.write_slot(0, other_scaling)
    assert winding.digest() != direct.digest()
    winding.write_slot(0, a)
    assert winding.digest() == direct.digest()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_slot_digest_is_the_sha256_of_the_slot_bytes(dtype: str) -> None:
    """The digest read in place (computed/residency/slot_digest.py) is the documented one: sha256 of the
    slot's bytes as `read_slot` copies them out, for written, cleared and never-written slots
    (whose digest the pool knows without reading them)."""
    spec = PoolSpec(num_layers=2, module_dims=DIMS, slots=4, max_rank=8, dtype=dtype)
    pool = MemoryPool(spec)
    pool.write_slot(0, adapter(1, 8, spec=spec))
    pool.write_slot(1, adapter(2, 3, spec=spec, modules=("v_proj",)))
    pool.write_slot(2, adapter(3, 5, spec=spec))
    pool.clear_slot(2)
    for slot in range(spec.slots):
        c = pool.read_slot(slot)
        h = hashlib.sha256()
        for m in spec.modules:
            h.update(c.A[m].tobytes() + c.B[m].tobytes())
        h.update(np.float32(c.scaling).tobytes() + np.int32(c.rank).tobytes())
        assert pool.slot_digest(slot) == h.hexdigest(), slot
    assert pool.slot_digest(2) == pool.slot_digest(3) != pool.slot_digest(0)
    assert pool.slot_digests() == [pool.slot_digest(s) for s in range(spec.slots)]


def test_a_pending_clear_keeps_the_slot_digest_until_it_applies() -> None:
    """A clear that waits for a reader leaves the slot, and so its digest, as written; once
    applied the slot's digest is that of its zero bytes, as read back."""
    pool = MemoryPool(SPEC)
    pool.write_slot(1, adapter(5, 8))
    written = pool.slot_digest(1)
    lease = pool.acquire(1)
    assert pool.clear_slot(1) is False  # pending behind the lease
    assert pool.slot_digest(1) == written
    lease.__exit__(None, None, None)
    assert_slot(pool, 1, None)
    assert pool.slot_digest(1) == MemoryPool(SPEC).slot_digest(1) != written
    c, h = pool.read_slot(1), hashlib.sha256()
    for m in SPEC.modules:
        h.update(c.A[m].tobytes() + c.B[m].tobytes())
    h.update(np.float32(c.scaling).tobytes() + np.int32(c.rank).tobytes())
    assert pool.slot_digest(1) == h.hexdigest() == hashlib.sha256(bytes(
        sum(c.A[m].nbytes + c.B[m].nbytes for m in SPEC.modules) + 8)).hexdigest()


def test_writes_are_in_place_and_never_recompile() -> None:
    """A pool compiles its writes when it is made; after that, writes and clears of adapters
    with any rank and any set of modules, in any slot, compile nothing and keep the buffers;
    and a slot holds only its last adapter, whatever modules its earlier holders had."""
    pool = MemoryPool(SPEC)
    pool.read_slot(0)  # a host read compiles on its first use (not a write; never on the step's path)
    pointers = buffer_pointers(pool)
    cache_sizes = (put_module._cache_size(), put_meta._cache_size())
    rng = np.random.default_rng(7)
    weights = [adapter(seed, rank, modules=modules) for seed, (rank, modules) in enumerate(
        [(1, None), (8, None), (3, ("q_proj",)), (5, ("down_proj", "v_proj")), (2, None)]
    )]
    expected: dict[int, SlotWeights | None] = {}
    with counting_compiles() as compiles:
        for step in range(200):
            slot = int(rng.integers(SPEC.slots))
            if rng.random() < 0.7:
                expected[slot] = weights[int(rng.integers(len(weights)))]
                assert pool.write_slot(slot, expected[slot])
            else:
                expected[slot] = None
                assert pool.clear_slot(slot)
            if step % 50 == 0:  # host reads must not pin the buffers either
                pool.read_slot(slot)
                pool.digest()
        jax.block_until_ready(pool.arrays)
    assert compiles == []
    assert (put_module._cache_size(), put_meta._cache_size()) == cache_sizes
    assert buffer_pointers(pool) == pointers

    replayed = MemoryPool(SPEC)
    for slot, w in expected.items():
        if w is not None:
            replayed.write_slot(slot, w)
    assert pool.digest() == replayed.digest()

    # The counter does see a compile when one happens.
    x = jnp.ones(5)
    with counting_compiles() as compiles:
        jax.jit(lambda x: x * 3)(x)
    assert compiles == [BACKEND_COMPILE]


def test_bfloat16_pool_rounds_to_nearest_even() -> None:
    spec = PoolSpec(num_layers=2, module_dims={"q_proj": (16, 16)}, slots=2, max_rank=8, dtype="bfloat16")
    pool = MemoryPool(spec)
    w = adapter(4, 8, spec=spec)
    a = w.pairs[(0, "q_proj")][0]
    # Halfway between 1 and 1 + 2**-7 rounds to even (1); just above halfway rounds up.
    a[0, :2] = [1 + 2**-8, 1 + 3 * 2**-9]
    pool.write_slot(1, w)
    got = pool.read_slot(1)
    assert got.A["q_proj"].dtype == jnp.bfloat16
    assert got.A["q_proj"][0, 0, :2].tolist() == [1.0, 1 + 2**-7]
    for (layer, _), (a, b) in w.pairs.items():
        reference_a = np.asarray(jnp.asarray(a).astype(jnp.bfloat16))
        reference_b = np.asarray(jnp.asarray(b).astype(jnp.bfloat16))
        assert got.A["q_proj"][layer].view(np.uint16).tolist() == reference_a.view(np.uint16).tolist()
        assert got.B["q_proj"][layer].view(np.uint16).tolist() == reference_b.view(np.uint16).tolist()
    assert got.scaling == np.float32(w.scaling)
    half = adapter(5, 4, spec=spec, dtype=np.float16)
    pool.write_slot(0, half)
    a16 = half.pairs[(1, "q_proj")][0]
    np.testing.assert_array_equal(
        pool.read_slot(0).A["q_proj"][1, :4], np.asarray(jnp.asarray(a16).astype(jnp.bfloat16))
    )


def test_leased_slot_is_written_when_its_last_reader_releases() -> None:
    pool = MemoryPool(SPEC)
    old, new, neighbour = adapter(1, 4), adapter(2, 6), adapter(3, 2)
    pool.write_slot(1, old)
    acquired = [threading.Event() for _ in range(2)]
    finish = [threading.Event() for _ in range(2)]

    def reader(i: int) -> None:  # stands in for an in-flight request on slot 1
        with pool.acquire(1):
            acquired[i].set()
            assert finish[i].wait(10)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    assert all(e.wait(10) for e in acquired)

    assert not pool.write_slot(1, new)
    assert pool.pending == {1}
    assert_slot(pool, 1, old)
    with pytest.raises(SlotDraining, match="slot 1 has a pending write"):
        pool.acquire(1)
    assert pool.write_slot(2, neighbour)  # other slots are not held back
    assert_slot(pool, 2, neighbour)

    finish[0].set()
    threads[0].join(10)
    assert_slot(pool, 1, old)  # one reader is still in flight
    finish[1].set()
    threads[1].join(10)
    assert pool.pending == frozenset()
    assert_slot(pool, 1, new)
    assert_slot(pool, 2, neighbour)
    with pool.acquire(1) as lease:
        assert not pool.clear_slot(1)
        assert pool.write_slot(2, old)
        assert not pool.write_slot(1, neighbour)  # the last operation decides
    assert_slot(pool, 1, neighbour)
    with pytest.raises(RuntimeError, match="already released"):
        pool.release(lease)


def test_writes_wait_for_a_reading_block() -> None:
    pool = MemoryPool(SPEC)
    w = adapter(1, 4)
    writer = threading.Thread(target=pool.write_slot, args=(0, w))
    with pool.reading() as arrays:
        writer.start()
        writer.join(0.2)
        assert writer.is_alive()  # held back: `arrays` stays valid
        assert not pool.write_slot(3, w)  # this thread's own write waits for the block too
        total = jnp.sum(arrays.A["q_proj"])
    writer.join(10)
    assert float(total) == 0.0
    assert_slot(pool, 0, w)
    assert_slot(pool, 3, w)
