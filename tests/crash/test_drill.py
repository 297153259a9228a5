"""loractl drill against a real fleet: agreement, a killed replica restarted from its run
file (never from what a heartbeat or a replica reports), and a wrong one caught."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from shared import runfile
from shared.client import ControlClient, RemoteError
from testkit.fleet import alive, loopback
from testkit.fleet import loractl, stop_pid, wait_for
from tests.helpers import Fleet

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


class Decoy:
    """A process the drill must never touch, and a fake replica socket that names it: what a
    spoofed heartbeat pointed old drills at (they killed the pid and ran the argv it reported)."""

    def __init__(self, tmp: Path) -> None:
        self.marker = tmp / "decoy-ran"
        self.proc = subprocess.Popen(["sleep", "600"])
        self.sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.address = loopback()
        self.sock.bind(self.address)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        about = {"pid": self.proc.pid, "argv": ["touch", str(self.marker)], "cwd": "/",
                 "state": "ACTIVE", "applied_seq": 0}
        while not self.stop.is_set():
            if self.sock.poll(100):
                *envelope, body = self.sock.recv_multipart()
                req = msgpack.unpackb(body)
                self.sock.send_multipart([*envelope, msgpack.packb(
                    {"v": 1, "id": req.get("id"), "ok": True, "result": about})])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close(0)
        stop_pid(self.proc)


def spoof_heartbeat(address: str, rid: str, decoy: Decoy) -> dict[str, Any]:
    with ControlClient(address) as c:
        try:
            c.call("heartbeat", {"id": rid, "address": decoy.address, "state": "ACTIVE",
                                 "applied_seq": 0, "logical_digest": "0" * 64,
                                 "pool_digest": "none"})
        except RemoteError as exc:
            return {"code": exc.code, "message": str(exc)}
    return {"code": None}


def test_drill_rebuilds_a_killed_replica_from_its_run_file_not_a_heartbeat(
        fleet: Fleet, tmp_path: Path) -> None:
    _setup(fleet)
    r1, r2 = fleet.replica("r1"), fleet.replica("r2")
    wait_for(lambda: fleet.converged(r1, r2), what="replicas")
    wait_for(lambda: len(json.loads(loractl(fleet.statesvc, "status", "--json").stdout)
                         ["replicas"]) == 2, what="heartbeats")
    run_file = r1.cache_dir / runfile.RUN_FILE
    old = runfile.read(run_file)
    assert old.pid == r1.proc.pid and old.listen == r1.listen  # type: ignore[union-attr]
    assert "pid" not in r1.status() and "argv" not in r1.status()
    decoy = Decoy(tmp_path)
    new_pid = None
    try:
        # a key-less local peer tries to point the live r1 at its decoy: refused
        refused = spoof_heartbeat(fleet.statesvc.control, "r1", decoy)
        assert refused["code"] == "conflict" and "live at" in refused["message"]
        code, report, stderr = drill(fleet, "--kill", "r1", "--run-file", str(run_file))
        new_pid = runfile.read(run_file).pid
        assert code == 0, stderr
        assert report["ok"] is True and report["head_seq"] == fleet.head()
        replicas = {c["replica"] for c in report["checks"]}
        assert replicas == {"r1", "r2", "drill-from-zero", "drill-from-snapshot"}
        kinds = {c["check"] for c in report["checks"]}
        assert {"logical_digest", "resident", "pinned", "probe:(base)", "probe:chat",
                "probe:code"} == kinds
        assert all(c["ok"] for c in report["checks"])
        assert set(report["timings"]) == {"rebuild_from-zero_s", "rebuild_from-snapshot_s",
                                          "kill_to_agreement_s"}
        assert report["restarted"]["argv"] == list(old.argv)
        assert new_pid != old.pid and not alive(old.pid)
        assert decoy.proc.poll() is None and not decoy.marker.exists()
    finally:
        decoy.close()
        if new_pid and new_pid != old.pid:  # the drill restarted it: stop it by pid
            os.kill(new_pid, signal.SIGTERM)
            wait_for(lambda: not alive(new_pid), what="r1 stopped")


def test_drill_kills_nothing_a_run_file_does_not_prove(fleet: Fleet, tmp_path: Path) -> None:
    """A run file whose pid now runs something else (pid reuse), or one others may write, is
    refused before anything is killed or started."""
    fleet.init(max_loras=2, max_rank=8)
    sleeper = subprocess.Popen(["sleep", "600"])
    try:
        run_file = tmp_path / "r9" / runfile.RUN_FILE
        runfile.write(run_file, runfile.RunFile("r9", sleeper.pid, ("computed", "serve"),
                                                str(tmp_path), loopback(), str(tmp_path)))
        code, _, stderr = drill(fleet, "--kill", "r9", "--run-file", str(run_file))
        assert code == 3 and "pid was reused, so nothing is killed" in stderr
        runfile.write(run_file, runfile.RunFile("r9", sleeper.pid, runfile.cmdline(sleeper.pid),
                                                str(tmp_path), loopback(), str(tmp_path)))
        run_file.chmod(0o666)
        code, _, stderr = drill(fleet, "--kill", "r9", "--run-file", str(run_file))
        assert code == 3 and "is not trusted" in stderr
        assert sleeper.poll() is None
    finally:
        stop_pid(sleeper)


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
    pool = next(c for c in failed if c["check"] == "resident")
    assert "slot(s) 1 (" in pool["detail"]
    assert "replica bad: resident slot(s) 1 (" in stderr
    assert all(c["ok"] for c in report["checks"] if c["replica"] != "bad")


def test_drill_resident_only_probes_what_each_live_replica_holds_and_fills_nothing(
        fleet: Fleet) -> None:
    fleet.init(max_loras=2, max_rank=32)
    for name, adapter in (("chat", "attn-qv-r8"), ("code", "all-r2"), ("mlp", "mlp-only-r16")):
        fleet.load(name, adapter)
    r1 = fleet.replica("r1")
    wait_for(lambda: fleet.converged(r1), what="r1")
    wait_for(lambda: len(json.loads(loractl(fleet.statesvc, "status", "--json").stdout)
                         ["replicas"]) == 1, what="heartbeat")
    before = r1.status()
    held = sorted(h["name"] for h in before["slots"].values())
    assert len(held) == 2  # three registered on two slots: one is not resident on r1
    code, report, stderr = drill(fleet, "--resident-only")
    assert code == 0, stderr
    assert report["ok"] is True and all(c["ok"] for c in report["checks"])
    checks: dict[str, set[str]] = {}
    for c in report["checks"]:
        checks.setdefault(c["replica"], set()).add(c["check"])
    assert checks["r1"] == {"logical_digest", "resident", "pinned", "no_fills", "probe:(base)",
                            *(f"probe:{n}" for n in held)}
    # the drill's own replicas probe every live adapter (filling slots there)
    assert {"probe:chat", "probe:code", "probe:mlp"} <= checks["drill-from-zero"]
    after = r1.status()
    assert after["residency"]["misses"] == before["residency"]["misses"]
    assert sorted(h["name"] for h in after["slots"].values()) == held


def test_drill_checks_a_pool_only_replica_without_probing_it(fleet: Fleet) -> None:
    """`computed serve --no-inference` answers no generate: the drill skips its probes, says
    so, and still compares its digests, resident slots and pinned adapters."""
    fleet.init(max_loras=2, max_rank=32)
    fleet.load("chat", "attn-qv-r8", pin=True)
    pool = fleet.replica("pool", args=("--no-inference",))
    wait_for(lambda: fleet.converged(pool), what="pool")
    wait_for(lambda: len(json.loads(loractl(fleet.statesvc, "status", "--json").stdout)
                         ["replicas"]) == 1, what="heartbeat")
    code, report, stderr = drill(fleet)
    assert code == 0, stderr
    assert report["ok"] is True and all(c["ok"] for c in report["checks"])
    checks = {c["check"]: c for c in report["checks"] if c["replica"] == "pool"}
    assert set(checks) == {"logical_digest", "resident", "pinned", "probes"}
    assert checks["probes"]["detail"] == "skipped: no inference (pool only)"
    assert checks["pinned"]["got"] == ["chat"]
