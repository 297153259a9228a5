"""The host tier and the fill worker on a real replica (real statesvc subprocess, real SQLite,
real JAX pool, real blobs): a miss is fetched and parsed beside admission, only the slot
write sits on its path (computed/residency/host_tier.py, docs/residency.md)."""
from __future__ import annotations

import threading
from pathlib import Path

import pytest

from computed.serving.admission import Fetching, GenerateError
from computed.residency.host_tier import FetchFailed
from computed.replica import Replica
from shared.client import ControlClient
from statesvc.tools.example import ExampleAssets
from testkit.fleet import loopback, wait_for
from tests.helpers import admit, live_replica
from tests.integration.test_residency import leased_and_a_waiter, load, use, where

pytestmark = pytest.mark.timeout(240)


def test_a_miss_is_fetched_in_the_background_then_served_from_the_host_tier(
        tmp_path: Path, example: ExampleAssets) -> None:
    with live_replica(tmp_path, example, max_loras=2) as (cmd, replica):
        load(cmd, replica, example, "a", "b", "c")
        assert sorted(where(replica)) == ["a", "b"]
        fetched = replica.blobs.fetches
        with pytest.raises(Fetching):  # the first ask starts the fetch and returns at once
            replica.admit("c", 0, 1)
        use(replica, "c", 1)  # waits for the worker, then the slot write
        assert replica.blobs.fetches == fetched + 1
        stats = replica.fills.stats()
        assert (stats["host_misses"], stats["host_hits"], stats["host_entries"]) == (1, 0, 1)
        assert stats["host_bytes"] > 0 and stats["fill_ms"]["miss"]["n"] == 1
        # c leaves its slot (LRU) and comes back from the host tier: no blob is read, not even
        # from the disk cache
        use(replica, "a", 2), use(replica, "b", 3)
        assert "c" not in where(replica)
        for blob in (replica.cache_dir / "blobs").iterdir():
            blob.unlink()
        use(replica, "c", 4)  # a hit in the host tier: no Fetching at all
        stats = replica.fills.stats()
        assert stats["host_hits"] == 1 and stats["fill_ms"]["host"]["n"] == 1
        assert stats["fill_ms"]["host"]["p50"] is not None
        assert replica.blobs.fetches == fetched + 1
        # the same contents as the fill from the blob
        fresh = Replica(replica.model, replica.client, tmp_path / "fresh", from_zero=True)
        fresh.bootstrap()
        use(fresh, "c")
        assert {h.name: d for h, d in fresh.resident().values()}["c"] == \
            {h.name: d for h, d in replica.resident().values()}["c"]


def test_unload_during_a_fetch_gives_unknown_adapter_and_drops_it(
        tmp_path: Path, example: ExampleAssets) -> None:
    with live_replica(tmp_path, example, max_loras=2) as (cmd, replica):
        load(cmd, replica, example, "a", "b", "c", "d")
        with replica.blobs._lock:  # the worker's blob read blocks: c's fetch is in flight
            with pytest.raises(Fetching):
                replica.admit("c", 0, 1)
            wait_for(lambda: replica.fills.fetching == ("c", replica.state.adapters["c"].version),
                     what="c's fetch to start")
            replica.want("d")  # queued behind it
            cmd("unload", name="c")
            cmd("unload", name="d")
            replica.catch_up()
            for ticket in (1, 2):  # the waiting request and a new one
                with pytest.raises(GenerateError) as info:
                    replica.admit("c", 0, ticket)
                assert info.value.code == "unknown_adapter"
        wait_for(lambda: replica.fills.fetching is None and not replica.fills.stats()["fetching"],
                 what="the fetch to end")
        stats = replica.fills.stats()
        assert stats["host_entries"] == 0 and stats["host_bytes"] == 0  # discarded
        assert sorted(where(replica)) == ["a", "b"]


def test_a_failed_fetch_is_a_clear_error_then_retried(tmp_path: Path,
                                                      example: ExampleAssets) -> None:
    with live_replica(tmp_path, example, max_loras=2) as (cmd, replica):
        load(cmd, replica, example, "a", "b", "c")
        statesvc = replica.blobs.client
        down = ControlClient(loopback(), timeout_s=0.2, retries=0)  # nothing listens there
        replica.blobs.client = down
        try:
            with pytest.raises(Fetching):
                replica.admit("c", 0, 1)
            wait_for(lambda: replica.fills.stats()["fetch_errors"] == 1, what="the failure")
            with pytest.raises(FetchFailed) as info:
                replica.admit("c", 0, 1)
            assert info.value.code == "not_ready" and "no answer from" in str(info.value)
            assert replica.residency is not None and replica.residency.reserved is None
            assert sorted(where(replica)) == ["a", "b"]  # no slot was touched
            g = admit(replica, "a", 0, 2)  # resident adapters are served meanwhile
            g.release()
        finally:
            replica.blobs.client = statesvc
            down.close()
        # after RETRY_S the next ask fetches again, from statesvc that answers now
        wait_for(lambda: _admitted(replica, "c", 3), what="c after the retry", timeout=30)
        assert "c" in where(replica)


def _admitted(replica: Replica, name: str, ticket: int) -> bool:
    try:
        replica.admit(name, 0, ticket).release()
        return True
    except (Fetching, FetchFailed):
        return False


def test_prefetch_and_a_host_tier_too_small_for_one_adapter(
        tmp_path: Path, example: ExampleAssets) -> None:
    with live_replica(tmp_path, example, max_loras=2) as (cmd, replica):
        replica.prefetch = True
        load(cmd, replica, example, "a", "b", "c")  # c has no free slot: parsed ahead
        wait_for(lambda: ("c", replica.state.adapters["c"].version) in replica.fills.host,
                 what="c prefetched")
        use(replica, "c", 1)
        assert replica.fills.stats()["host_hits"] == 1  # no request waited for its fetch
        # a host tier of 0 bytes keeps nothing, and a miss is still served
        replica.fills.host.limit = 0
        replica.fills.host.retain(lambda k: False)
        replica.prefetch = False
        load(cmd, replica, example, "d")
        use(replica, "d", 2)
        assert len(replica.fills.host) == 0 and "d" in where(replica)


def test_a_waiter_without_a_slot_is_fetched_meanwhile(tmp_path: Path,
                                                      example: ExampleAssets) -> None:
    with live_replica(tmp_path, example, max_loras=2) as (cmd, replica):
        ga, gb = leased_and_a_waiter(cmd, replica, example)  # c's fetch runs meanwhile
        key = ("c", replica.state.adapters["c"].version)
        wait_for(lambda: key in replica.fills.host, what="c fetched while it waits")
        ga.release()
        got = replica.admit("c", 0, 3)  # the reserved slot, from the host tier: no Fetching
        assert got.slot == ga.slot
        got.release(), gb.release()


def test_a_step_waits_for_a_queued_miss_and_prefills_it_before_its_decode(
        tmp_path: Path, example: ExampleAssets) -> None:
    """A request whose adapter is being fetched when a step begins joins that step (prefilled
    before its decode) once the fetch ends within half a decode step, instead of waiting a
    whole step behind the running requests (docs/residency.md, "What a miss adds")."""
    from computed.serving.engine import Engine
    from computed.model.loader import load_model
    from computed.model.runner import Runner
    from shared.replica_protocol import generate_args
    with live_replica(tmp_path, example, max_loras=2) as (cmd, replica):
        load(cmd, replica, example, "a", "b", "c")
        assert "c" not in where(replica)
        config, params = load_model(example.model_dir)
        engine = Engine(Runner(config, params, max_batch=4, max_len=64), replica)
        assert engine.submit("a", generate_args([5, 6, 7], adapter="a", max_new_tokens=8),
                             "a") is None
        engine.step()
        assert engine.decode_s > 0
        engine.decode_s = 600.0  # here the wait ends with the fetch, never with its bound
        replica.blobs._lock.acquire()  # c's fetch cannot end before the step begins
        assert engine.submit("c", generate_args([5, 6, 7], adapter="c", max_new_tokens=8),
                             "c") is None
        threading.Timer(0.3, replica.blobs._lock.release).start()
        engine.step()
        running = {r.req.req_id: r for r in engine.rows if r is not None}
        assert set(running) == {"a", "c"}
        assert len(running["c"].output) == 2  # its first token from the prefill, then decoded
        assert where(replica)["c"] == running["c"].grant.slot
        # what residency added to each: c waited from its first pass with a row to its fetch
        # and slot write; a's adapter was resident, and it never waited for one
        a, c = running["a"], running["c"]
        assert a.req.eligible is None and c.req.eligible is not None
        assert 0 <= a.residency_s < c.residency_s <= c.admitted - c.req.arrived


def test_a_miss_queued_beside_resident_requests_joins_their_prefill(
        tmp_path: Path, example: ExampleAssets) -> None:
    """A miss submitted with a request whose adapter is resident is prefilled with it, once
    its fetch ends within the step's budget, instead of after that prefill and the step's
    decode (docs/residency.md, "What a miss adds")."""
    from computed.serving.engine import Engine
    from computed.model.loader import load_model
    from computed.model.runner import Runner
    from shared.replica_protocol import generate_args
    with live_replica(tmp_path, example, max_loras=2) as (cmd, replica):
        load(cmd, replica, example, "a", "b", "c")
        assert "a" in where(replica) and "c" not in where(replica)
        config, params = load_model(example.model_dir)
        engine = Engine(Runner(config, params, max_batch=4, max_len=64), replica)
        engine.decode_s = 600.0  # here the wait ends with the fetch, never with its bound
        replica.blobs._lock.acquire()  # c's fetch cannot end before the step begins
        for name in ("a", "c"):
            assert engine.submit(name, generate_args([5, 6, 7], adapter=name,
                                                     max_new_tokens=8), name) is None
        threading.Timer(0.3, replica.blobs._lock.release).start()
        engine.step()
        running = {r.req.req_id: r for r in engine.rows if r is not None}
        assert set(running) == {"a", "c"}
        # one prefill for both (the same admission pass set), then the step's decode
        assert [len(running[n].output) for n in ("a", "c")] == [2, 2]
        assert running["a"].prefill_s > running["c"].prefill_s  # a was admitted first
        assert running["c"].req.eligible is not None and running["a"].req.eligible is None
