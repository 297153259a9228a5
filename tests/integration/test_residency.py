"""Residency on a real replica (real statesvc subprocess, real SQLite, real JAX pool): which
slot holds which adapter is the replica's choice, filled on a miss (docs/residency.md).

Requests are stood in for by `admit` and the grants it returns (a grant holds its slot's
lease until released), so every interleaving is exact; tests/parity/test_residency_serving.py
sends real requests through `computed serve`."""
from __future__ import annotations

from pathlib import Path

import pytest

from computed.serving.admission import GenerateError, AdmittedAdapter, NoSlot
from computed.replica import Replica
from statesvc.tools.example import ExampleAssets
from testkit.jaxcount import counting_compiles
from tests.helpers import Command, admit, live_replica

pytestmark = pytest.mark.timeout(240)


def where(replica: Replica) -> dict[str, int]:
    return {h.name: s for s, h in replica.holders.items()}


def load(cmd: Command, replica: Replica, example: ExampleAssets, *names: str,
         pin: bool = False) -> None:
    """Load each of `names` and apply it, one diff at a time as the stream brings them."""
    dirs = sorted(example.adapter_dirs)
    for name in names:
        chosen = dirs[sum(map(ord, name)) % len(dirs)]
        cmd("load", name=name, path=str(example.adapter_dirs[chosen]), pin=pin)
        replica.catch_up()


def use(replica: Replica, name: str, ticket: int = 0) -> int:
    """One request for `name` admitted and finished; returns the slot it ran on."""
    grant = admit(replica, name, 0, ticket)
    grant.release()
    return grant.slot


def leased_and_a_waiter(cmd: Command, replica: Replica,
                        example: ExampleAssets) -> tuple[AdmittedAdapter, AdmittedAdapter]:
    """On 2 slots: requests (tickets 1, 2) running on a and b, and one for c (ticket 3) that
    waits for a slot; returns the grants of a and b."""
    load(cmd, replica, example, "a", "b", "c")
    ga, gb = admit(replica, "a", 0, 1), admit(replica, "b", 0, 2)
    with pytest.raises(NoSlot):
        admit(replica, "c", 0, 3)
    return ga, gb


def test_free_slots_fill_at_replay_then_misses_evict_lru_never_leased(
        tmp_path: Path, example: ExampleAssets) -> None:
    with live_replica(tmp_path, example, max_loras=3) as (cmd, replica):
        load(cmd, replica, example, "a", "b", "c", "d", "e")
        # the replica filled its free slots as the loads came; d and e wait for a request
        assert sorted(where(replica)) == ["a", "b", "c"]
        res = replica.residency
        assert res is not None
        use(replica, "a"), use(replica, "c")  # b is now the least recently used
        with counting_compiles() as compiles:
            slot_b = where(replica)["b"]
            assert use(replica, "d") == slot_b  # a miss evicts the LRU: b
            assert sorted(where(replica)) == ["a", "c", "d"]
            # a leased slot is never evicted: a holds a lease, so e evicts c (LRU unleased)
            held = admit(replica, "a", 0, 1)
            use(replica, "d")
            slot_c = where(replica)["c"]
            assert use(replica, "e") == slot_c
            assert where(replica)["a"] == held.slot
            held.release()
        assert compiles == []  # fills are donated slot writes
        assert (res.misses, res.evictions) == (2, 2) and res.hits >= 4
        # each slot holds exactly its adapter's contents: a fresh replica from the log, filling
        # the same versions, computes the same digest per version
        mine = {h.name: d for h, d in replica.resident().values()}
        fresh = Replica(replica.model, replica.client, tmp_path / "fresh", from_zero=True)
        fresh.bootstrap()
        for name in mine:
            use(fresh, name)
        assert {h.name: d for h, d in fresh.resident().values()
                if h.name in mine} == mine


def test_pinned_adapters_stay_resident(tmp_path: Path, example: ExampleAssets) -> None:
    with live_replica(tmp_path, example, max_loras=3) as (cmd, replica):
        load(cmd, replica, example, "x", "y", "z")  # fill every slot unpinned first
        load(cmd, replica, example, "p", pin=True)  # a pinned load takes a slot at once
        load(cmd, replica, example, "q", pin=True)
        pinned = {n: where(replica)[n] for n in ("p", "q")}
        for i, name in enumerate(["x", "y", "z"] * 3):
            free = use(replica, name, i)
            assert free not in pinned.values()
            assert {n: where(replica)[n] for n in ("p", "q")} == pinned
        assert use(replica, "p") == pinned["p"]
        # a replica rebuilt from the log holds the pinned adapters before any request
        fresh = Replica(replica.model, replica.client, tmp_path / "fresh", from_zero=True)
        fresh.bootstrap()
        assert {"p", "q"} <= set(where(fresh))


def test_no_slot_waits_and_the_oldest_waiter_gets_the_reserved_slot(
        tmp_path: Path, example: ExampleAssets) -> None:
    with live_replica(tmp_path, example, max_loras=2) as (cmd, replica):
        load(cmd, replica, example, "hot1", "hot2", "cold")
        first = admit(replica, "hot1", 0, 1)  # running requests on both slots
        second = admit(replica, "hot2", 0, 2)
        with pytest.raises(NoSlot):
            admit(replica, "cold", 0, 3)  # waits: not an error
        res = replica.residency
        assert res is not None and res.reserved == (3, first.slot)  # the LRU slot
        # a hot stream: hot2 keeps being served, hot1 gets no new lease on the reserved slot
        running: list[AdmittedAdapter] = [second]
        for ticket in range(4, 40):
            running.append(admit(replica, "hot2", 0, ticket))
            running.pop(0).release()
            with pytest.raises(NoSlot):
                admit(replica, "hot1", 0, ticket)
            with pytest.raises(NoSlot):  # a younger request for another cold adapter waits
                admit(replica, "cold", 0, ticket + 100)
        first.release()  # hot1's running request finishes (within its max_new_tokens)
        with pytest.raises(NoSlot):
            admit(replica, "cold", 0, 200)  # not for a younger waiter
        got = admit(replica, "cold", 0, 3)
        assert got.slot == first.slot and got.name == "cold" and res.reserved is None
        got.release()
        running[0].release()


def test_unload_makes_waiters_unknown_and_frees_the_slot_after_its_leases(
        tmp_path: Path, example: ExampleAssets) -> None:
    with live_replica(tmp_path, example, max_loras=2) as (cmd, replica):
        ga, gb = leased_and_a_waiter(cmd, replica, example)
        cmd("unload", name="c")
        cmd("unload", name="a")  # a request still runs on a
        replica.catch_up()
        for name, ticket in (("c", 3), ("a", 4)):
            with pytest.raises(GenerateError) as info:
                admit(replica, name, 0, ticket)  # the waiting request, and a new one
            assert info.value.code == "unknown_adapter"
        res, pool = replica.residency, replica.pool
        assert res is not None and pool is not None and res.reserved is None
        assert "a" not in where(replica) and res.free_slots() == []  # leased: not free yet
        ga.release()
        assert res.free_slots() == [ga.slot]
        assert pool.read_slot(ga.slot).rank == 0  # cleared by the last lease's release
        gb.release()


def test_replace_keeps_running_requests_on_the_old_version(
        tmp_path: Path, example: ExampleAssets) -> None:
    with live_replica(tmp_path, example, max_loras=2) as (cmd, replica):
        dirs = example.adapter_dirs
        cmd("load", name="a", path=str(dirs["attn-qv-r8"]))
        replica.catch_up()
        old = admit(replica, "a", 0, 1)
        old_digest = replica.pool.slot_digest(old.slot)  # type: ignore[union-attr]
        cmd("load", name="a", path=str(dirs["all-r2"]), replace=True)
        replica.catch_up()
        new = admit(replica, "a", 0, 2)
        assert new.version > old.version and new.slot != old.slot
        # the old version's slot still holds it for the running request
        assert replica.pool.slot_digest(old.slot) == old_digest  # type: ignore[union-attr]
        old.release()
        new.release()
        assert where(replica) == {"a": new.slot}


def test_a_waiter_that_leaves_gives_up_its_reservation(tmp_path: Path,
                                                       example: ExampleAssets) -> None:
    with live_replica(tmp_path, example, max_loras=2) as (cmd, replica):
        ga, gb = leased_and_a_waiter(cmd, replica, example)
        assert replica.residency is not None and replica.residency.reserved == (3, ga.slot)
        replica.withdraw(3)  # e.g. it timed out in the queue: the engine withdraws it
        assert replica.residency.reserved is None
        ga.release()
        again = admit(replica, "a", 0, 4)  # a's slot takes new leases again
        assert again.slot == ga.slot
        again.release()
        gb.release()
