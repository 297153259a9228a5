"""The slot map's rules (computed/residency/slots.py), as pure logic; tests/integration/
test_residency.py holds the same rules through a real replica and `computed serve`."""
from __future__ import annotations

from computed.residency.slots import ResidentVersion, SlotMap


def holder(name: str, *, pinned: bool = False, version: int = 1) -> ResidentVersion:
    return ResidentVersion(name, version, name * 8, pinned)


class Slots:
    """A residency over `n` slots whose leases the test holds."""

    def __init__(self, n: int) -> None:
        self.leases = [0] * n
        self.res = SlotMap(n, busy=lambda s: self.leases[s] > 0)

    def fill(self, name: str, ticket: int | None = None, *, pinned: bool = False) -> int:
        slot = self.res.pinned_victim() if pinned else self.res.victim(ticket)
        assert slot is not None
        self.res.fill(slot, holder(name, pinned=pinned), ticket=ticket, demand=not pinned)
        return slot


def test_fills_take_free_slots_lowest_first_then_evict_lru() -> None:
    t = Slots(3)
    assert [t.fill(n) for n in "abc"] == [0, 1, 2]
    t.res.lease(t.res.slot_of("a", 1) or 0)  # a is now the most recently used
    assert t.fill("d") == 1  # b was the least recently used
    assert t.res.slot_of("b", 1) is None and t.res.slot_of("d", 1) == 1
    assert t.fill("e") == 2  # then c
    assert (t.res.misses, t.res.evictions, t.res.hits) == (5, 2, 1)


def test_a_leased_slot_is_never_evicted() -> None:
    t = Slots(2)
    t.fill("a"), t.fill("b")
    t.leases[0] = t.leases[1] = 1
    assert t.res.victim(1) is None  # every slot leased: the request waits
    t.leases[0] = 0
    assert t.res.victim(1) == 0


def test_pinned_adapters_are_never_evicted() -> None:
    t = Slots(3)
    t.fill("p", pinned=True), t.fill("q", pinned=True), t.fill("a")
    for i, name in enumerate("bcdefg"):
        assert t.fill(name, ticket=i) == 2  # only the unpinned slot cycles
    assert {h.name for h in t.res.holders.values()} == {"p", "q", "g"}
    # a pinned fill evicts an unpinned adapter, even a leased one (its write then waits)
    t2 = Slots(2)
    t2.fill("a"), t2.fill("b")
    t2.leases[0] = t2.leases[1] = 1
    assert t2.res.pinned_victim() in (0, 1)


def test_the_oldest_waiter_reserves_the_lru_slot_and_a_hot_stream_cannot_starve_it() -> None:
    t = Slots(2)
    t.fill("hot1"), t.fill("hot2")
    t.leases = [1, 1]  # both hot adapters are running
    assert t.res.victim(10) is None
    assert t.res.wait(10) == 0  # the oldest waiter reserves the least recently used slot
    assert t.res.wait(11) is None  # a younger waiter does not take it over
    # new requests for hot1 get no lease on the reserved slot; hot2's slot is not reserved
    assert t.res.blocked(0, 12) and not t.res.blocked(1, 12)
    assert not t.res.blocked(0, 10)
    for ticket in range(13, 50):  # a hot stream: hot2 keeps its slot leased, hot1 waits
        assert t.res.blocked(0, ticket)
    t.leases[0] = 0  # hot1's running requests finish
    assert t.res.victim(11) is None  # the younger waiter cannot take the reserved slot
    assert t.res.victim(10) == 0  # the waiter can
    t.res.fill(0, holder("cold"), ticket=10)
    assert t.res.reserved is None and t.res.slot_of("hot1", 1) is None


def test_an_older_waiter_takes_the_reservation_and_a_refused_one_gives_it_up() -> None:
    t = Slots(2)
    t.fill("a"), t.fill("b")
    t.leases = [1, 1]
    assert t.res.wait(7) == 0
    assert t.res.wait(3) == 0 and t.res.reserved == (3, 0)
    t.res.forget(3)  # e.g. its adapter was unloaded: unknown_adapter
    assert t.res.reserved is None


def test_drop_frees_the_slot_once_its_leases_end() -> None:
    t = Slots(2)
    t.fill("a"), t.fill("b")
    t.leases[0] = 1
    t.res.drop(0)  # unloaded while a request runs on it
    assert t.res.slot_of("a", 1) is None
    assert t.res.free_slots() == []  # still leased
    t.leases[0] = 0
    assert t.res.free_slots() == [0]


def test_a_reserved_slot_freed_by_an_unload_goes_to_its_waiter() -> None:
    t = Slots(2)
    t.fill("a"), t.fill("b")
    t.leases = [1, 1]
    assert t.res.wait(5) == 0
    t.res.drop(0)  # a is unloaded while its request runs
    t.leases[0] = 0  # ...and finishes: slot 0 is free, and still reserved
    assert t.res.victim(9) is None  # not for a younger request
    assert t.res.victim(5) == 0
