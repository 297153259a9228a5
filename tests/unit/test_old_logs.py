"""A log written before the registry and residency split still replays (docs/residency.md).

tests/fixtures/log-v1/state.db was written by main's code at 58c42ac (make_log.py there):
pool init (4 slots), loads with slots, a pinned adapter, an unload, a replace that moved its
slot, and snapshots at seq 4 and 8 that hold slots and digests of them. Today's code upcasts
each event when it reads it (the slot is dropped) and must reach the same registry.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from shared.canonical import digest
from shared.config import DEFAULT_MAX_ADAPTERS
from shared.events import AdapterLoaded, AdapterUnloaded, decode_body
from shared.reducer import State, apply, canonical, from_canonical, logical_digest, \
    verified_snapshot
from statesvc.tools.example import ExampleAssets
from testkit.inproc import call, open_service

FIXTURE = Path(__file__).parent.parent / "fixtures" / "log-v1"


def _old_log(tmp_path: Path) -> Path:
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(FIXTURE / "state.db", data / "state.db")
    return data


def _without_slots(adapter: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in adapter.items() if k != "slot"}


def test_an_old_log_replays_to_the_same_registry(tmp_path: Path) -> None:
    expected = json.loads((FIXTURE / "expected.json").read_text())
    old = expected["canonical"]
    assert all("slot" in a for a in old["adapters"])  # the fixture is what it says it is
    svc = open_service(_old_log(tmp_path), snapshot_every=0)
    try:
        state = svc.state
        assert state.seq == expected["seq"] == 9
        now = canonical(state)
        assert now["adapters"] == [_without_slots(a) for a in old["adapters"]]
        assert now["pool"] == {**old["pool"], "max_adapters": DEFAULT_MAX_ADAPTERS}
        assert {a.name: (a.version, a.pinned) for a in state.adapters.values()} == {
            "alpha": (8, False), "beta": (3, True), "gamma": (6, False)}
        # from seq 0, and from the old snapshot at seq 8 (checked against the digest it was
        # stored with, over the data as recorded), the same registry
        assert svc.rebuild(use_snapshot=False) == svc.rebuild() == state
        # the replica's path: every event decoded from its stored payload, slot dropped
        replayed = State()
        for ev in svc.store.read(0, 100):
            body = ev.body
            assert not hasattr(body, "slot")
            replayed = apply(replayed, ev.seq, body)
        assert replayed == state
        snap = call(svc, "snapshot")
        assert snap["seq"] == 8 and "slot" in snap["state"]["adapters"][0]
        assert verified_snapshot(snap["seq"], snap["state"], snap["digest"]) == \
            svc.rebuild(until=8, use_snapshot=False)
        # the digest is over the registry only: version 2 of the logical digest differs from
        # the old code's (over slots too), and statesvc and replicas compute it alike
        assert logical_digest(state) != expected["digest"]
        assert call(svc, "digest", seq=9)["digest"] == logical_digest(replayed)
        assert digest(old) == expected["digest"]
    finally:
        svc.store.close()


def test_an_old_log_takes_new_events(tmp_path: Path, example: ExampleAssets) -> None:
    svc = open_service(_old_log(tmp_path), snapshot_every=0)
    try:
        # an adapter recorded with a slot unloads with a slot-less event; a new name registers
        # past the old 4 slots (--max-loras is now slots per replica, not a registry cap)
        assert call(svc, "unload", name="gamma") == {"seq": 10, "name": "gamma", "version": 6}
        for i in range(4):
            call(svc, "load", name=f"n{i}", path=str(example.adapter_dirs["attn-qv-r8"]))
        call(svc, "load", name="alpha", path=str(example.adapter_dirs["attn-all-r4"]),
             replace=True)
        [ev] = svc.store.read(14, 1)
        assert ev.payload["replaces"] == {"version": 8} and "slot" not in ev.payload
        assert len(svc.state.adapters) == 6
        assert svc.rebuild(use_snapshot=False) == svc.state
    finally:
        svc.store.close()


def test_old_payloads_upcast_when_read() -> None:
    loaded = {"name": "a", "version": 5, "slot": 3, "sha256": "ab" * 32, "size": 10, "rank": 4,
              "alpha": 8.0, "scaling": 2.0, "use_rslora": False, "targets": ["q_proj"],
              "pinned": False, "replaces": {"version": 2, "slot": 0}}
    body = decode_body("adapter.loaded", loaded)
    assert isinstance(body, AdapterLoaded) and body.replaces is not None
    assert body.replaces.version == 2
    assert decode_body("adapter.unloaded", {"name": "a", "version": 5, "slot": 3}) == \
        AdapterUnloaded("a", 5)
    # a slot of the wrong type is still refused, as any malformed field
    try:
        decode_body("adapter.unloaded", {"name": "a", "version": 5, "slot": "3"})
    except ValueError as exc:
        assert "slot" in str(exc)
    else:
        raise AssertionError("a malformed slot was taken")
    assert from_canonical(1, {"pool": None, "adapters": [loaded]}).adapters["a"].version == 5
