"""A map bounded by the bytes of its values, least recently used evicted first: pure logic.

Used for a replica's host tier of parsed weights (computed/residency/host_tier.py) and for the blob bytes
statesvc keeps for the fleet's fetches (statesvc/persistence/). No lock of
its own: each user holds its lock around every call.

Rules: the sizes of the entries never exceed `limit` (an entry larger than the whole bound is
not kept); putting an entry evicts the least recently used ones until it fits, where a use is
a `get` that found it or a `put`; `drop` removes an entry at once.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass
class Entry(Generic[V]):
    value: V
    size: int


class ByteLRU(Generic[K, V]):
    """LRU map K -> V bounded by the sum of the entries' sizes (`size_of`, in bytes)."""

    def __init__(self, limit: int, size_of: Callable[[V], int]) -> None:
        if limit < 0:
            raise ValueError(f"the byte bound is {limit} bytes; it must be >= 0")
        self.limit = limit
        self.size_of = size_of
        self._entries: OrderedDict[K, Entry[V]] = OrderedDict()  # least recently used first
        self.bytes = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def keys(self) -> list[K]:
        return list(self._entries)

    def get(self, key: K) -> Entry[V] | None:
        """The entry for `key`, now the most recently used."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry

    def put(self, key: K, value: V) -> bool:
        """Keep `value` as the most recently used entry, evicting LRU entries to fit; False
        when it is larger than the whole bound (then it is not kept)."""
        size = self.size_of(value)
        self.drop(key)
        if size > self.limit:
            return False
        while self.bytes + size > self.limit:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.size
            self.evictions += 1
        self._entries[key] = Entry(value, size)
        self.bytes += size
        return True

    def drop(self, key: K) -> bool:
        """Remove `key`'s entry (not counted as an eviction); True when there was one."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self.bytes -= entry.size
        return True

    def retain(self, keep: Callable[[K], bool]) -> int:
        """Drop every entry whose key `keep` refuses; returns how many were dropped."""
        gone = [k for k in self._entries if not keep(k)]
        for k in gone:
            self.drop(k)
        return len(gone)
