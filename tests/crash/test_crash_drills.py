"""Crash drills: a replica killed inside a slot write, and adapters whose source is gone."""
from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from shared.fleet import wait_for
from tests.helpers import Fleet, held

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
