"""Every log has an identity, and a replica never applies another log's events.

The id is a uuid4 that statesvc records in the genesis event; reads, heartbeats and diffs
carry it. A log written before log ids existed keeps its digests and gets a stable id.
"""
from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from shared.client import ControlClient, new_event_id
from shared.config import UUID_RE
from shared.projections import MODULES
from shared.reducer import logical_digest
from statesvc.service import StateService
from statesvc.persistence.base import NewEvent
from statesvc.persistence.sqlite import FileBlobStore, SqliteEventStore, sqlite_url
from statesvc.tools.example import ExampleAssets
from testkit.fleet import Computed, StateSvc, loractl, wait_for
from testkit.inproc import call, init_pool, open_service
from tests.helpers import Fleet

pytestmark = pytest.mark.timeout(240)

LOG_READS = ("list", "events", "snapshot", "status")


def test_the_genesis_names_the_log_and_every_read_says_which(tmp_path: Path,
                                                             example: ExampleAssets) -> None:
    svc = open_service(tmp_path / "data")
    assert all(call(svc, cmd)["log_id"] is None for cmd in LOG_READS)  # no genesis yet
    assert call(svc, "digest", seq=0)["log_id"] is None
    init_pool(svc, example.model_dir)
    log_id = call(svc, "events")["events"][0]["payload"]["log_id"]
    assert uuid.UUID(log_id).version == 4 and UUID_RE.fullmatch(log_id)
    call(svc, "load", name="a", path=str(example.adapter_dirs["attn-qv-r8"]))
    assert all(call(svc, cmd)["log_id"] == log_id for cmd in LOG_READS)
    assert call(svc, "digest", seq=2)["log_id"] == log_id
    svc.store.close()
    again = open_service(tmp_path / "data")
    assert again.log_id == log_id
    other = open_service(tmp_path / "other")  # another data dir: another log
    init_pool(other, example.model_dir)
    assert other.log_id not in (None, log_id)
    # the same settings, so the same pool view and digest but for the id
    assert call(other, "list")["pool"] == call(again, "list")["pool"]
    again.store.close()
    other.store.close()


# A log as the code before log ids wrote it: no log_id in the genesis (nor max_adapters, and its
# loads carry slots). Its digests (at seq 1 and 2) must not change within a digest version.
# Version 2 (the registry and residency split, docs/protocol.md): the digest is over the
# registry, which has no slots and has max_adapters (upcast to its default), so both changed;
# version 1 gave 00a9bd6a... and 63f14aa9... here.
LEGACY_GENESIS = {"fingerprint": "f" * 64, "model_config": {"model_type": "llama", "hidden_size": 64},
                  "num_layers": 2, "module_dims": {m: [64, 64] for m in MODULES}, "max_loras": 2,
                  "max_rank": 8, "targets": list(MODULES), "dtype": "float32"}
LEGACY_LOADED = {"name": "a", "version": 2, "slot": 0, "sha256": "ab" * 32, "size": 100,
                 "rank": 4, "alpha": 8.0, "scaling": 2.0, "use_rslora": False,
                 "targets": ["q_proj"], "pinned": False, "replaces": None}
LEGACY_DIGESTS = {1: "9a95e1dcb9f59d0f753569f9d0d3224a097e3793679f310d9eee6d7017b6ed1f",
                  2: "a67a788cf727b282bada945aa7674d51d2f7ae9e86feded533bbcc9b93bd1aaa"}


def test_a_log_from_before_log_ids_keeps_its_digests_and_a_stable_identity(
        tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    store = SqliteEventStore(sqlite_url(data))
    store.append([NewEvent(1, "00000000-0000-4000-8000-000000000001", "pool.configured",
                           LEGACY_GENESIS, "local"),
                  NewEvent(2, "00000000-0000-4000-8000-000000000002", "adapter.loaded",
                           LEGACY_LOADED, "local")])
    svc = StateService(store, FileBlobStore(data / "blobs"), snapshot_every=3)
    assert {seq: svc.digest_at(seq) for seq in (1, 2)} == LEGACY_DIGESTS
    log_id = svc.log_id
    assert log_id is not None and UUID_RE.fullmatch(log_id)
    assert call(svc, "status")["log_id"] == log_id
    # a snapshot written now (seq 3) holds the pool as it was recorded: no log_id, and the
    # digest of replaying every event
    call(svc, "unload", name="a")
    snap = call(svc, "snapshot")
    assert snap["seq"] == 3 and "log_id" not in snap["state"]["pool"]
    assert snap["digest"] == logical_digest(svc.rebuild(use_snapshot=False))
    store.close()
    reopened = open_service(data)
    assert reopened.log_id == log_id  # derived from the stored genesis: the same every time
    assert reopened.digest_at(2) == LEGACY_DIGESTS[2]
    reopened.store.close()


def _subscribe(address: str) -> zmq.Socket[Any]:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(address)
    return sub


def test_heartbeats_and_diffs_carry_the_log_id(statesvc: StateSvc, example: ExampleAssets) -> None:
    sub = _subscribe(statesvc.publish)
    try:
        assert sub.poll(5000)
        topic, frame = sub.recv_multipart()
        assert topic == b"hb" and msgpack.unpackb(frame)["log_id"] is None  # head 0
        with ControlClient(statesvc.control) as c:
            c.call("pool.init", {"event_id": new_event_id(), "model": str(example.model_dir),
                                 "max_loras": 2, "max_rank": 8, "targets": "all"})
            log_id = c.call("status")["log_id"]
        seen: dict[bytes, dict[str, Any]] = {}
        deadline = time.monotonic() + 10
        while (b"diff" not in seen or seen.get(b"hb", {}).get("head_seq") != 1) \
                and time.monotonic() < deadline:
            if sub.poll(500):
                topic, frame = sub.recv_multipart()
                seen[topic] = msgpack.unpackb(frame)
        assert seen[b"diff"]["log_id"] == log_id == seen[b"diff"]["pool"]["log_id"]
        assert seen[b"hb"]["log_id"] == log_id
        assert log_id in loractl(statesvc, "status").stdout
    finally:
        sub.close(0)


def replica_on_log_a(fleet: Fleet) -> tuple[Computed, str]:
    """A replica r1 at the head (seq 2) of the fleet's log, and that log's id."""
    r1 = fleet.replica("r1")
    fleet.init()
    fleet.load("chat", "attn-qv-r8")
    wait_for(lambda: fleet.converged(r1), what="r1 at the head of log A")
    status = r1.status()
    assert status["log_id"] is not None and status["applied_seq"] == 2
    return r1, status["log_id"]


def restart_on_same_ports(fleet: Fleet, data_dir: Path) -> StateSvc:
    """Stop the fleet's statesvc and start one on the same ports with `data_dir`."""
    fleet.statesvc.stop()
    fleet.statesvc = StateSvc(data_dir, control=fleet.statesvc.control,
                              publish=fleet.statesvc.publish).start()
    return fleet.statesvc


def test_a_replica_refuses_another_log_on_the_same_ports(tmp_path: Path, fleet: Fleet) -> None:
    r1, log_a = replica_on_log_a(fleet)
    before = r1.status()

    # statesvc restarted on the same ports with another data dir: log B, empty at first
    data_a = fleet.statesvc.data_dir
    restart_on_same_ports(fleet, tmp_path / "data-b")
    wait_for(lambda: r1.status()["state"] == "REFUSED", what="r1 refusing the empty log B")
    assert "no events yet" in r1.status()["last_error"]
    fleet.init()
    fleet.load("sql", "mlp-only-r16")
    fleet.load("code", "all-r2")  # log B is now ahead of what r1 applied: its events would fit
    with fleet.client() as c:
        log_b = c.call("status")["log_id"]
    assert log_b not in (None, log_a)
    wait_for(lambda: log_b in (r1.status()["last_error"] or ""), what="r1 naming log B")
    after = r1.status()
    assert after["state"] == "REFUSED"
    assert log_a in after["last_error"] and "--cache-dir" in after["last_error"]
    for key in ("applied_seq", "logical_digest", "pool_digest", "slot_digests", "slots",
                "log_id"):
        assert after[key] == before[key], key

    # its own log back on the ports: it follows it again
    restart_on_same_ports(fleet, data_a)
    fleet.load("sql", "mlp-only-r16")
    wait_for(lambda: fleet.converged(r1), what="r1 back on log A")
    assert r1.status()["log_id"] == log_a and r1.status()["last_error"] is None


def test_a_restarted_replica_refuses_another_log_with_its_cache(tmp_path: Path,
                                                                fleet: Fleet) -> None:
    r1, log_a = replica_on_log_a(fleet)
    r1.stop()
    restart_on_same_ports(fleet, tmp_path / "data-b")
    fleet.init()
    fleet.load("code", "all-r2")
    fleet.load("sql", "mlp-only-r16")
    r1.start()
    wait_for(lambda: r1.status()["state"] == "REFUSED", what="r1 refusing log B at start")
    status = r1.status()
    assert status["applied_seq"] == 0 and status["slots"] == {}
    assert log_a in status["last_error"]
    # its cache still names log A
    saved = msgpack.unpackb((r1.cache_dir / "state.msgpack").read_bytes())
    assert saved["log_id"] == log_a and saved["seq"] == 2
    # with an empty cache dir it follows log B
    fresh = fleet.replica("fresh")
    wait_for(lambda: fleet.converged(fresh), what="a fresh replica on log B")
    with fleet.client() as c:
        assert fresh.status()["log_id"] == c.call("status")["log_id"] != log_a


def test_a_replica_cache_from_before_log_ids_takes_the_log_of_statesvc(fleet: Fleet) -> None:
    r1, log_id = replica_on_log_a(fleet)
    r1.stop()
    path = r1.cache_dir / "state.msgpack"
    saved = msgpack.unpackb(path.read_bytes())
    del saved["log_id"]  # as today's code wrote it
    path.write_bytes(msgpack.packb(saved))
    fleet.load("sql", "mlp-only-r16")
    r1.start()
    wait_for(lambda: fleet.converged(r1), what="r1 at the head again")
    assert r1.status()["log_id"] == log_id
    assert msgpack.unpackb(path.read_bytes())["log_id"] == log_id
