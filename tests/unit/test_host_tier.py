"""The host tier's LRU and byte bound (computed/residency/host_tier.py, shared/lru.py's ByteLRU): pure logic."""
from __future__ import annotations

import numpy as np
import pytest

from computed.residency.host_tier import HostLRU, weights_bytes
from computed.residency.pool import SlotWeights


def tier(limit: int) -> HostLRU[str, int]:
    return HostLRU(limit, size_of=lambda v: v)  # each value is its own size in bytes


def test_evicts_least_recently_used_to_stay_within_the_byte_bound() -> None:
    t = tier(100)
    for k in "abc":
        assert t.put(k, 30)
    assert t.bytes == 90 and t.keys() == ["a", "b", "c"]
    assert t.get("a") is not None  # a use: b is now the least recently used
    assert t.put("d", 30)
    assert t.keys() == ["c", "a", "d"] and t.bytes == 90 and t.evictions == 1
    assert t.put("e", 70)  # evicts as many as it takes: c, then a
    assert t.keys() == ["d", "e"] and t.bytes == 100 and t.evictions == 3
    assert t.get("b") is None


def test_an_entry_larger_than_the_bound_is_not_kept_and_evicts_nothing() -> None:
    t = tier(50)
    t.put("a", 20)
    assert not t.put("big", 51)
    assert t.keys() == ["a"] and t.bytes == 20 and t.evictions == 0
    assert not tier(0).put("x", 1)


def test_put_again_replaces_and_drop_and_retain_free_bytes() -> None:
    t = tier(100)
    t.put("a", 40)
    t.put("a", 10)  # a new value for the same key: counted once
    assert t.bytes == 10 and len(t) == 1
    t.put("b", 20), t.put("c", 30)
    assert t.drop("b") and not t.drop("b")
    assert t.bytes == 40 and t.evictions == 0  # a drop is no eviction
    assert t.retain(lambda k: k != "c") == 1
    assert t.keys() == ["a"] and t.bytes == 10
    entry = t.get("a")
    assert entry is not None and entry.value == 10 and entry.size == 10


def test_a_stream_of_puts_never_exceeds_the_bound() -> None:
    rng = np.random.default_rng(0)
    t = tier(1000)
    for i in range(2000):
        t.put(str(int(rng.integers(300))), int(rng.integers(1, 400)))
        assert t.bytes <= 1000
        assert t.bytes == sum(e.size for k in t.keys() if (e := t._entries[k]))
    with pytest.raises(ValueError, match=">= 0"):
        tier(-1)


def test_weights_bytes_counts_every_array() -> None:
    w = SlotWeights(scaling=1.0, rank=4, pairs={
        (0, "q_proj"): (np.zeros((4, 8), np.float32), np.zeros((8, 4), np.float32)),
        (1, "v_proj"): (np.zeros((4, 8), np.float32), np.zeros((16, 4), np.float32))})
    assert weights_bytes(w) == 4 * (32 + 32 + 32 + 64)
