"""Crash drills: a replica killed inside a slot write, and adapters whose source is gone."""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from testkit.fleet import loractl, wait_for
from tests.helpers import Fleet, held
from tests.parity.test_serving import Client, generate

pytestmark = pytest.mark.timeout(240)


def test_replica_killed_during_a_slot_write_recovers(fleet: Fleet) -> None:
    fleet.init()
    slow = fleet.replica("slow", env={"LORAPLANE_FAULT_SLOW_WRITE_S": "30"})
    wait_for(lambda: slow.status()["state"] == "ACTIVE", what="ACTIVE")
    fleet.load("a", "attn-qv-r8")
    # the replica has written the slot and now sits inside the write section
    wait_for(lambda: (slow.cache_dir / "blobs").exists() and any(
        (slow.cache_dir / "blobs").iterdir()), what="the blob to be cached")
    time.sleep(0.5)
    assert slow.status()["applied_seq"] == 1  # the advance has not finished
    slow.kill()
    fleet.load("b", "all-r2")
    slow.env = {}
    slow.start()
    cold = fleet.replica("cold")
    wait_for(lambda: fleet.converged(slow, cold), what="recovery")
    s, c = slow.status(), cold.status()
    assert (s["logical_digest"], s["pool_digest"]) == (c["logical_digest"], c["pool_digest"])
    assert held(s) == {"0": {"name": "a", "version": 2}, "1": {"name": "b", "version": 3}}


def test_replay_rebuilds_adapters_whose_source_was_deleted(fleet: Fleet, tmp_path: Path) -> None:
    fleet.init()
    sources = {}
    for name, adapter in [("a", "attn-qv-r8"), ("b", "mlp-only-r16")]:
        sources[name] = tmp_path / "user" / name
        shutil.copytree(fleet.example.adapter_dirs[adapter], sources[name])
        fleet.cmd("load", name=name, path=str(sources[name]))
    shutil.rmtree(tmp_path / "user")
    fleet.statesvc.stop()
    fleet.statesvc.start()
    r = fleet.replica("cold")
    wait_for(lambda: fleet.converged(r), what="replay without the sources")
    assert held(r.status()) == {"0": {"name": "a", "version": 2},
                                   "1": {"name": "b", "version": 3}}
    assert r.status()["last_error"] is None


def test_replica_killed_during_a_demand_fill_comes_back_and_agrees(fleet: Fleet) -> None:
    """A request's miss: the fill worker fetched the blob, the engine wrote the slot and sits
    in the write (the fault's pause) when the replica is SIGKILLed; restarted on its cache dir,
    it serves the adapter and the drill finds every slot equal to the replay's."""
    fleet.init(max_loras=2)
    slow = fleet.replica("slow", env={"LORAPLANE_FAULT_SLOW_WRITE_S": "4"})
    wait_for(lambda: slow.status()["state"] == "ACTIVE", what="ACTIVE")
    for name, adapter in [("a", "attn-qv-r8"), ("b", "all-r2"), ("c", "mlp-only-r16")]:
        fleet.load(name, adapter)
    wait_for(lambda: fleet.converged(slow), what="the loads (two fill the free slots)",
             timeout=120)
    resident = {h["name"] for h in held(slow.status()).values()}
    assert len(resident) == 2
    cold = ({"a", "b", "c"} - resident).pop()
    client = Client(slow.listen)
    try:
        client.send("generate", generate(cold, [1, 2, 3], n=2))
        wait_for(lambda: slow.status()["blob_fetches"] == 3, what="c's blob fetched")
        time.sleep(1.0)  # the worker parses it and the engine writes the slot: in the pause
        slow.kill()
    finally:
        client.close()
    slow.env = {}
    slow.start()
    wait_for(lambda: fleet.converged(slow), what="recovery")
    client = Client(slow.listen)
    try:
        client.send("generate", generate(cold, [1, 2, 3], n=2))
        reply = client.recv()
    finally:
        client.close()
    assert reply["ok"], reply
    wait_for(lambda: len(json.loads(loractl(fleet.statesvc, "status", "--json").stdout)
                         ["replicas"]) >= 1, what="a heartbeat")
    res = loractl(fleet.statesvc, "drill", "--diffs", fleet.statesvc.publish, "--json",
                  check=False, timeout=280)
    report = json.loads(res.stdout)
    assert res.returncode == 0 and report["ok"], res.stderr
    assert {"a", "b", "c"} >= {h["name"] for h in held(slow.status()).values()}
