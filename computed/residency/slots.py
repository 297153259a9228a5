"""The slot map: which registered adapter version each device slot of this replica holds.

The log holds the registry (shared/reducer.py); the slots are this replica's own cache,
decided here and never recorded as events (docs/residency.md). Pure bookkeeping, no JAX:
the residency manager (manager.py `make_resident`) asks it where an adapter goes and writes
the slot itself.

Rules:
- a slot is *busy* while requests hold leases on it or a write waits for them (the pool
  says which, `busy`); a busy slot is never chosen for a fill, except by a pinned adapter,
  whose write then waits for the leases (pool.py's pending writes);
- a fill takes the lowest free slot, else the least recently used slot that holds an
  unpinned adapter, is not busy and is not reserved for another request;
- pinned adapters are never evicted;
- fairness: the oldest waiting request (the smallest ticket) that finds no slot reserves the
  least recently used unpinned slot. No new lease is granted on a reserved slot, so once its
  running requests finish (each within its max_new_tokens) the waiter fills it; a stream of
  requests for resident adapters cannot starve it.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ResidentVersion:
    """What one slot holds: a registered adapter version."""

    name: str
    version: int
    sha256: str
    pinned: bool


class SlotMap:
    """The slot map of one replica; every change goes through its methods."""

    def __init__(self, slots: int, *, busy: Callable[[int], bool]) -> None:
        self.slots = slots
        self.busy = busy
        self.holders: dict[int, ResidentVersion] = {}
        self._where: dict[tuple[str, int], int] = {}
        self._used: dict[int, int] = {}  # slot -> tick of its last lease or fill
        self._tick = itertools.count(1)
        self.reserved: tuple[int, int] | None = None  # (ticket, slot)
        self.hits = self.misses = self.evictions = 0
        self.generation = 0  # changes whenever a slot's holder does

    # ---- lookups ---------------------------------------------------------------

    def slot_of(self, name: str, version: int) -> int | None:
        return self._where.get((name, version))

    def blocked(self, slot: int, ticket: int) -> bool:
        """True when `slot` is reserved for another request than `ticket`: no new lease."""
        return self.reserved is not None and self.reserved[1] == slot \
            and self.reserved[0] != ticket

    def free_slots(self) -> list[int]:
        return [s for s in range(self.slots) if s not in self.holders and not self.busy(s)]

    def _lru(self, candidates: list[int]) -> int | None:
        return min(candidates, key=lambda s: self._used.get(s, 0), default=None)

    def _unpinned(self) -> list[int]:
        return [s for s, h in self.holders.items() if not h.pinned]

    def victim(self, ticket: int | None = None) -> int | None:
        """The slot a fill for request `ticket` may take now: the lowest free one, else the least
        recently used unpinned slot that is not busy and not reserved for another request."""
        free = [s for s in self.free_slots() if ticket is None or not self.blocked(s, ticket)]
        if free:
            return free[0]
        return self._lru([s for s in self._unpinned() if not self.busy(s)
                          and not (ticket is not None and self.blocked(s, ticket))
                          and not (ticket is None and self.reserved is not None
                                   and self.reserved[1] == s)])

    def pinned_victim(self) -> int:
        """The slot a pinned adapter takes: a free one, else the least recently used unpinned
        one that is not busy, else the least recently used unpinned one (its write waits for
        its leases). There always is one: at most slots - 1 adapters are pinned."""
        free = self.free_slots()
        if free:
            return free[0]
        unpinned = self._unpinned()
        slot = self._lru([s for s in unpinned if not self.busy(s)])
        if slot is None:  # every unpinned slot is leased: the write waits for its leases
            slot = self._lru(unpinned)
        if slot is None:  # a slot with neither holder nor free: its clear waits for leases
            slot = self._lru([s for s in range(self.slots) if s not in self.holders])
        if slot is None:
            raise RuntimeError(f"every one of the {self.slots} slots holds a pinned adapter")
        return slot

    # ---- changes ---------------------------------------------------------------

    def lease(self, slot: int, ticket: int | None = None) -> None:
        """A request was granted a lease on resident `slot` (a hit)."""
        self.hits += 1
        self._touch(slot)
        self._done_waiting(ticket)

    def fill(self, slot: int, holder: ResidentVersion, *, ticket: int | None = None,
             demand: bool = True) -> None:
        """`slot` now holds `holder` (its write was submitted). `demand`: a request's miss,
        counted as one; else the replica filled it by itself (pinned, or a free slot)."""
        if slot in self.holders:
            self.evictions += 1
            self.drop(slot)
        self.holders[slot] = holder
        self._where[(holder.name, holder.version)] = slot
        self.generation += 1
        self._touch(slot)
        if demand:
            self.misses += 1
            self._done_waiting(ticket)
        if self.reserved is not None and self.reserved[1] == slot and holder.pinned:
            self.reserved = None  # a pinned adapter took it: the waiter reserves anew

    def drop(self, slot: int) -> None:
        """`slot` no longer routes its adapter (unloaded, replaced or evicted)."""
        holder = self.holders.pop(slot, None)
        if holder is not None:
            self._where.pop((holder.name, holder.version), None)
            self.generation += 1

    def wait(self, ticket: int) -> int | None:
        """Request `ticket` found no slot: the oldest such request reserves the least recently
        used unpinned slot (returned; None when every slot is pinned or free, or an older
        request holds the reservation)."""
        if self.reserved is not None and self.reserved[0] < ticket:
            return None
        if self.reserved is not None and self.reserved[0] == ticket:
            return self.reserved[1]
        slot = self._lru(self._unpinned())
        self.reserved = None if slot is None else (ticket, slot)
        return slot

    def forget(self, ticket: int) -> None:
        """Request `ticket` leaves without a slot (refused): its reservation ends."""
        self._done_waiting(ticket)

    def _done_waiting(self, ticket: int | None) -> None:
        if ticket is not None and self.reserved is not None and self.reserved[0] == ticket:
            self.reserved = None

    def _touch(self, slot: int) -> None:
        self._used[slot] = next(self._tick)
