"""Replay-based recovery drills: prove that any replica can be rebuilt from the log.

A drill starts two fresh replicas beside the fleet, one replaying the whole
log from seq 0 (no snapshot) and one from the latest snapshot and its tail,
optionally SIGKILLs a live replica and restarts it, waits until every replica
has applied the same seq, then compares each of them with statesvc's logical
digest and with the from-zero replica's pool digest (slot by slot) and its
greedy output for a fixed probe on the base model and on every live adapter.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from shared.client import ControlClient, RemoteError, Unavailable
from shared.keys import ClientKeys, client_keys
from shared.processes import loopback, start_ready, stop_pid

PROBE = [1, 2, 3, 4, 5, 6, 7, 8]
PROBE_TOKENS = 8
ZERO, SNAPSHOT = "drill-from-zero", "drill-from-snapshot"


class DrillError(Exception):
    """The drill could not run (not a disagreement: those are checks)."""


@dataclass
class Check:
    replica: str
    check: str
    ok: bool
    expected: Any = None
    got: Any = None
    detail: str = ""


@dataclass
class Report:
    ok: bool = True
    head_seq: int = 0
    checks: list[Check] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "head_seq": self.head_seq,
                "checks": [asdict(c) for c in self.checks], "timings": self.timings}


def _call(address: str, cmd: str, args: dict[str, Any] | None = None,
          timeout: float = 10.0, keys: ClientKeys | None = None) -> Any:
    with ControlClient(address, timeout_s=timeout, retries=0, keys=keys) as c:
        return c.call(cmd, args or {})


def _status(address: str) -> dict[str, Any] | None:
    try:
        return dict(_call(address, "status", timeout=3.0))
    except (Unavailable, RemoteError):
        return None


class Drill:
    def __init__(self, state: str, diffs: str, *, model: Path | None = None,
                 progress: Callable[[str, int, int], None] | None = None,
                 timeout: float = 300.0, key_files: tuple[str, str] | None = None) -> None:
        self.state, self.diffs = state, diffs
        self.key_files = key_files  # (secret key, server key) under --auth
        self.keys = client_keys(*key_files) if key_files else None
        self.model = model
        self.progress = progress or (lambda *_: None)
        self.timeout = timeout
        self.report = Report()
        self.procs: list[subprocess.Popen[Any]] = []

    def _wait(self, what: str, done: Callable[[], bool]) -> float:
        t0 = time.monotonic()
        while not done():
            if time.monotonic() - t0 > self.timeout:
                raise DrillError(f"timed out after {self.timeout:g} s waiting for {what}")
            time.sleep(0.1)
        return time.monotonic() - t0

    def run(self, kill: str | None = None) -> Report:
        statesvc = _call(self.state, "status", keys=self.keys)
        head = int(statesvc["head_seq"])
        live = {r["id"]: r for r in statesvc["replicas"] if r["state"] != "STALE"}
        if kill is not None and kill not in live:
            raise DrillError(f"no live replica {kill!r}; `loractl status` lists them")
        about = {rid: _status(r["address"]) for rid, r in live.items()}
        model = self.model or next((Path(a["model"]) for a in about.values() if a), None)
        if model is None:
            raise DrillError("no live replica reports its model; pass --model DIR")
        with tempfile.TemporaryDirectory(prefix="loraplane-drill-") as tmp:
            try:
                t0 = time.monotonic()  # both start together: each time runs from here
                fresh = {ZERO: self._start(model, Path(tmp), ZERO, from_zero=True),
                         SNAPSHOT: self._start(model, Path(tmp), SNAPSHOT, from_zero=False)}
                for name, address in fresh.items():
                    self._wait(f"{name} to rebuild", self._reached(name, address, head))
                    self.report.timings[f"rebuild_{name.removeprefix('drill-')}_s"] = \
                        round(time.monotonic() - t0, 3)
                if kill is not None:
                    self.report.timings["kill_to_agreement_s"] = self._kill_and_restart(
                        kill, live[kill]["address"], about[kill])
                addresses = {**{rid: r["address"] for rid, r in live.items()}, **fresh}
                self._compare(addresses)
            finally:
                for proc in self.procs:
                    stop_pid(proc)
        return self.report

    # ---- steps ---------------------------------------------------------------------

    def _start(self, model: Path, tmp: Path, name: str, *, from_zero: bool) -> str:
        argv = [str(Path(sys.executable).parent / "computed"), "serve", "--model", str(model),
                "--state", self.state, "--diffs", self.diffs, "--listen", loopback(),
                "--replica-id", name, "--cache-dir", str(tmp / name), "--no-heartbeat",
                "--no-warmup", "--max-batch", "4",
                *(["--replay-from-zero"] if from_zero else []),
                *(["--key", self.key_files[0], "--server-key", self.key_files[1]]
                  if self.key_files else [])]
        proc, ready = start_ready(argv, log=tmp / f"{name}.log")
        self.procs.append(proc)
        return ready.split("listen=")[1].split()[0]

    def _reached(self, name: str, address: str, head: int) -> Callable[[], bool]:
        def check() -> bool:
            s = _status(address)
            if s is None:
                return False
            self.progress(name, max(s["applied_seq"], s.get("syncing_seq", 0)), head)
            return bool(s["state"] == "ACTIVE" and s["applied_seq"] >= head)
        return check

    def _kill_and_restart(self, rid: str, address: str, about: dict[str, Any] | None) -> float:
        if not about or "pid" not in about:
            raise DrillError(f"replica {rid} does not report its pid; cannot kill it")
        t0 = time.monotonic()
        os.kill(about["pid"], signal.SIGKILL)
        self._wait(f"{rid} to die", lambda: _status(address) is None)
        log = Path(tempfile.gettempdir()) / f"loraplane-{rid}.log"
        subprocess.Popen(about["argv"], cwd=about.get("cwd"), stdout=subprocess.DEVNULL,
                         stderr=log.open("ab"), start_new_session=True)

        def agrees() -> bool:
            s = _status(address)
            if s is None or s["state"] != "ACTIVE":
                return False
            head = _call(self.state, "status", keys=self.keys)["head_seq"]
            digest = _call(self.state, "digest", {"seq": s["applied_seq"]},
                           keys=self.keys)["digest"]
            self.progress(rid, s["applied_seq"], head)
            return bool(s["applied_seq"] >= head and s["logical_digest"] == digest)

        self._wait(f"{rid} to come back and agree", agrees)
        return round(time.monotonic() - t0, 3)

    def _settled(self, addresses: dict[str, str]) -> tuple[int, dict[str, dict[str, Any]]]:
        """Every replica's status at one common applied seq (the log may move meanwhile)."""
        for _ in range(50):
            head = int(_call(self.state, "status", keys=self.keys)["head_seq"])
            self._wait("every replica to reach the head", lambda: all(
                (s := _status(a)) is not None and s["applied_seq"] >= head
                and s["pool_digest"] != "pending" for a in addresses.values()))
            statuses = {rid: _status(a) for rid, a in addresses.items()}
            seqs = {s["applied_seq"] for s in statuses.values() if s}
            if len(seqs) == 1 and None not in statuses.values():
                return seqs.pop(), statuses  # type: ignore[return-value]
        raise DrillError("the log kept moving: replicas never stood at one seq")

    def _compare(self, addresses: dict[str, str]) -> None:
        seq, statuses = self._settled(addresses)
        self.report.head_seq = seq
        expected = _call(self.state, "digest", {"seq": seq}, keys=self.keys)["digest"]
        ref = statuses[ZERO]
        listed = _call(self.state, "list", keys=self.keys)["adapters"]
        adapters = [None, *sorted(a["name"] for a in listed)]
        probes = {rid: self._probe(addr, adapters, seq) for rid, addr in addresses.items()}
        for rid, s in statuses.items():
            self._check(rid, "logical_digest", expected, s["logical_digest"],
                        "differs from statesvc's at this seq")
            if s["pool_digest"] != ref["pool_digest"]:
                slots = [i for i, (a, b) in enumerate(zip(s["slot_digests"] or [],
                                                          ref["slot_digests"] or [])) if a != b]
                self._check(rid, "pool_digest", ref["pool_digest"], s["pool_digest"],
                            f"slot(s) {', '.join(map(str, slots))} differ from the replay "
                            "from seq 0")
            else:
                self._check(rid, "pool_digest", ref["pool_digest"], s["pool_digest"], "")
            for adapter in adapters:
                label = f"probe:{adapter or '(base)'}"
                self._check(rid, label, probes[ZERO][adapter], probes[rid][adapter],
                            "greedy output differs from the replay from seq 0")

    def _probe(self, address: str, adapters: list[str | None], seq: int) -> dict[str | None, Any]:
        out: dict[str | None, Any] = {}
        for adapter in adapters:
            try:
                res = _call(address, "generate", {"adapter": adapter, "input_ids": PROBE,
                                                  "max_new_tokens": PROBE_TOKENS,
                                                  "min_seq": seq}, timeout=120.0)
                out[adapter] = res["output_ids"]
            except (RemoteError, Unavailable) as exc:
                out[adapter] = f"error: {exc}"
        return out

    def _check(self, rid: str, what: str, expected: Any, got: Any, why: str) -> None:
        ok = expected == got
        self.report.checks.append(Check(rid, what, ok, expected, got, "" if ok else why))
        self.report.ok &= ok
