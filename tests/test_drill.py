"""loractl drill against a real fleet: agreement, a killed replica, and a wrong one caught."""
from __future__ import annotations

import json
import os
import signal

import pytest

from tests.fleet import Fleet
from tests.procs import loractl, wait_for

pytestmark = pytest.mark.timeout(300)


def _setup(fleet: Fleet, **env: str) -> None:
    fleet.init(max_loras=4, max_rank=32)
    fleet.load("chat", "attn-qv-r8")
    fleet.load("code", "all-r2")
    fleet.load("gone", "mlp-only-r16")
    fleet.cmd("unload", name="gone")


def drill(fleet: Fleet, *args: str) -> tuple[int, dict, str]:
    res = loractl(fleet.statesvc, "drill", "--diffs", fleet.statesvc.publish, "--json", *args,
                  check=False, timeout=280)
    return res.returncode, json.loads(res.stdout) if res.stdout else {}, res.stderr


def test_drill_agrees_and_rebuilds_a_killed_replica(fleet: Fleet) -> None:
    _setup(fleet)
    r1, r2 = fleet.replica("r1"), fleet.replica("r2")
    wait_for(lambda: fleet.converged(r1, r2), what="replicas")
    wait_for(lambda: len(json.loads(loractl(fleet.statesvc, "status", "--json").stdout)
                         ["replicas"]) == 2, what="heartbeats")
    old_pid = r1.status()["pid"]
    code, report, stderr = drill(fleet, "--kill", "r1")
    new_pid = None
    try:
        new_pid = r1.status()["pid"]
        assert code == 0, stderr
        assert report["ok"] is True and report["head_seq"] == fleet.head()
        replicas = {c["replica"] for c in report["checks"]}
        assert replicas == {"r1", "r2", "drill-from-zero", "drill-from-snapshot"}
        kinds = {c["check"] for c in report["checks"]}
        assert {"logical_digest", "pool_digest", "probe:(base)", "probe:chat",
                "probe:code"} == kinds
        assert all(c["ok"] for c in report["checks"])
        assert set(report["timings"]) == {"rebuild_from-zero_s", "rebuild_from-snapshot_s",
                                          "kill_to_agreement_s"}
        assert new_pid != old_pid
    finally:
        if new_pid and new_pid != old_pid:  # the drill restarted it: stop it by pid
            os.kill(new_pid, signal.SIGTERM)
            wait_for(lambda: not os.path.exists(f"/proc/{new_pid}") or
                     open(f"/proc/{new_pid}/stat").read().split()[2] == "Z", what="r1 stopped")


def test_drill_names_a_wrong_replica_and_its_slot(fleet: Fleet) -> None:
    _setup(fleet)
    good = fleet.replica("good")
    bad = fleet.replica("bad", env={"LORAPLANE_FAULT_PERTURB_SLOT": "1"})
    wait_for(lambda: fleet.converged(good, bad), what="replicas")
    wait_for(lambda: len(json.loads(loractl(fleet.statesvc, "status", "--json").stdout)
                         ["replicas"]) == 2, what="heartbeats")
    code, report, stderr = drill(fleet)
    assert code == 1 and report["ok"] is False
    failed = [c for c in report["checks"] if not c["ok"]]
    assert {c["replica"] for c in failed} == {"bad"}
    pool = next(c for c in failed if c["check"] == "pool_digest")
    assert "slot(s) 1 differ" in pool["detail"]
    assert "replica bad: pool_digest slot(s) 1" in stderr
    assert all(c["ok"] for c in report["checks"] if c["replica"] != "bad")
