"""Replay-based recovery drills: prove that any replica can be rebuilt from the log.

A drill starts two fresh replicas beside the fleet, one replaying the whole
log from seq 0 (no snapshot) and one from the latest snapshot and its tail,
optionally SIGKILLs a live replica and restarts it (or, with several statesvc
instances of one log, SIGKILLs one instance, shows every live replica ACTIVE
through another, and restarts it), waits until every replica
has applied the same seq, then compares each of them with statesvc's logical
digest, runs a fixed greedy probe on the base model and on every live adapter
(each probe of an adapter that a replica does not hold fills a slot there) and
compares its output with the from-zero replica's (with `resident_only`, each live
replica is probed only on the adapters it holds, so the drill fills no slot there and
the check `no_fills` says so; the registry is still compared by the logical digest and
the drill's own replicas probe every live adapter; a replica that serves no inference,
`computed serve --no-inference`, is not probed: its check `probes` says so), then compares
the contents of every resident slot with the from-zero replica's for the same adapter version
(which slot holds it is each replica's own choice) and checks that every
pinned adapter is resident everywhere.

What to kill and how to restart it comes only from the operator's side: the
replica's run file (shared/runfile.py), checked before the kill. Nothing a
peer reports over the network (a heartbeat's address, a replica's `status`)
is ever killed or executed.
"""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from shared import runfile
from shared.client import ControlClient, RemoteError, Unavailable, list_adapters
from shared.endpoints import split_addresses
from shared.keys import ClientKeys, client_keys
from shared.replica_protocol import GENERATE, STATUS, generate_args
from statesvc.tools.processes import Computed, Endpoints, alive

PROBE = [1, 2, 3, 4, 5, 6, 7, 8]
PROBE_TOKENS = 8
POOL_ONLY = "skipped: no inference (pool only)"
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
    restarted: dict[str, Any] | None = None  # the killed replica's run file, as restarted

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "head_seq": self.head_seq,
                "checks": [asdict(c) for c in self.checks], "timings": self.timings,
                "restarted": self.restarted}


def _call(address: str, cmd: str, args: dict[str, Any] | None = None,
          timeout: float = 10.0, keys: ClientKeys | None = None) -> Any:
    with ControlClient(address, timeout_s=timeout, retries=0, keys=keys) as c:
        return c.call(cmd, args or {})


def _status(address: str, keys: ClientKeys | None) -> dict[str, Any] | None:
    try:
        return dict(_call(address, STATUS, timeout=3.0, keys=keys))
    except (Unavailable, RemoteError):
        return None


def default_run_file(replica_id: str) -> Path:
    """Where `computed serve --replica-id ID` writes its run file by default."""
    return Path("var") / "replicas" / replica_id / runfile.RUN_FILE


class Drill:
    def __init__(self, state: str, diffs: str, *, model: Path | None = None,
                 progress: Callable[[str, int, int], None] | None = None,
                 timeout: float = 300.0, key_files: tuple[str, str] | None = None,
                 replica_keys: ClientKeys | None = None, resident_only: bool = False) -> None:
        self.state, self.diffs = state, diffs
        self.resident_only = resident_only  # probe live replicas only on what they hold
        self.key_files = key_files  # (secret key, server key) under --auth
        self.keys = client_keys(*key_files) if key_files else None
        self.replica_keys = replica_keys  # for the live replicas' listen sockets (--auth)
        self.fresh: set[str] = set()  # the drill's own replicas: loopback, no auth
        self.model = model
        self.progress = progress or (lambda *_: None)
        self.timeout = timeout
        self.report = Report()
        self.procs: list[Computed] = []

    def _status(self, address: str) -> dict[str, Any] | None:
        return _status(address, None if address in self.fresh else self.replica_keys)

    def _wait(self, what: str, done: Callable[[], bool]) -> float:
        t0 = time.monotonic()
        while not done():
            if time.monotonic() - t0 > self.timeout:
                raise DrillError(f"timed out after {self.timeout:g} s waiting for {what}")
            time.sleep(0.1)
        return time.monotonic() - t0

    def run(self, kill: str | None = None, *, run_file: Path | None = None,
            kill_statesvc: Path | None = None) -> Report:
        """The drill; with `kill`, SIGKILL that replica and restart it from its run file
        (`run_file`, default ./var/replicas/ID/run.json), after checking it (runfile.read);
        with `kill_statesvc`, the same for the statesvc instance of that data dir."""
        instance = self._instance(kill_statesvc) if kill_statesvc is not None else None
        statesvc = _call(self.state, "status", keys=self.keys)
        head = int(statesvc["head_seq"])
        live: dict[str, str] = {}
        for address in split_addresses(self.state):  # each instance lists its own replicas
            try:
                listed = _call(address, "status", timeout=3.0, keys=self.keys)["replicas"]
            except (Unavailable, RemoteError):
                continue
            live.update({r["id"]: r["address"] for r in listed if r["state"] != "STALE"})
        run, path = None, run_file or default_run_file(kill or "")
        if kill is not None:
            try:
                run = runfile.read(path)
                if run.replica_id != kill:
                    raise runfile.RunFileError(f"{path} is the run file of replica "
                                               f"{run.replica_id}, not {kill}")
                runfile.check_running(run, path)
            except runfile.RunFileError as exc:
                raise DrillError(str(exc)) from None
            live[kill] = run.listen  # where the operator's file says it listens
        model = self.model or (Path(run.model) if run else None) or next(
            (Path(s["model"]) for a in live.values()
             if (s := self._status(a)) is not None and "model" in s), None)
        if model is None:
            raise DrillError("no live replica reports its model to this key; pass --model DIR")
        with tempfile.TemporaryDirectory(prefix="loraplane-drill-") as tmp:
            try:
                t0 = time.monotonic()  # both start together: each time runs from here
                fresh = {ZERO: self._start(model, Path(tmp), ZERO, from_zero=True),
                         SNAPSHOT: self._start(model, Path(tmp), SNAPSHOT, from_zero=False)}
                for name, address in fresh.items():
                    self._wait(f"{name} to rebuild", self._reached(name, address, head))
                    self.report.timings[f"rebuild_{name.removeprefix('drill-')}_s"] = \
                        round(time.monotonic() - t0, 3)
                if run is not None:
                    self.report.timings["kill_to_agreement_s"] = self._kill_and_restart(run, path)
                if instance is not None:
                    self._kill_statesvc(*instance, live)
                self._compare({**live, **fresh})
            finally:
                for proc in self.procs:
                    proc.stop()
        return self.report

    # ---- steps ---------------------------------------------------------------------

    def _start(self, model: Path, tmp: Path, name: str, *, from_zero: bool) -> str:
        replica = Computed(model, Endpoints(self.state, self.diffs), tmp / name, replica_id=name,
                           log_file=tmp / f"{name}.log", extra_args=(
                               "--no-heartbeat", "--no-warmup", "--max-batch", "4",
                               *(["--replay-from-zero"] if from_zero else []),
                               *(["--key", self.key_files[0], "--server-key", self.key_files[1]]
                                 if self.key_files else [])))
        self.procs.append(replica)
        replica.start()
        address = replica.ready.split("listen=")[1].split()[0]
        self.fresh.add(address)
        return address

    def _reached(self, name: str, address: str, head: int) -> Callable[[], bool]:
        def check() -> bool:
            s = self._status(address)
            if s is None:
                return False
            self.progress(name, max(s["applied_seq"], s.get("syncing_seq", 0)), head)
            return bool(s["state"] == "ACTIVE" and s["applied_seq"] >= head)
        return check

    def _kill_and_restart(self, run: runfile.RunFile, path: Path) -> float:
        rid = run.replica_id
        t0 = self._kill(run, path)
        self._restart(run, path, "replica", rid)
        address = run.listen

        def agrees() -> bool:
            s = self._status(address)
            if s is None or s["state"] != "ACTIVE":
                return False
            head = _call(self.state, "status", keys=self.keys)["head_seq"]
            digest = _call(self.state, "digest", {"seq": s["applied_seq"]},
                           keys=self.keys)["digest"]
            self.progress(rid, s["applied_seq"], head)
            return bool(s["applied_seq"] >= head and s["logical_digest"] == digest)

        self._wait(f"{rid} to come back and agree", agrees)
        return round(time.monotonic() - t0, 3)

    def _kill(self, run: runfile.RunFile, path: Path) -> float:
        """SIGKILL the process of `run` once it is checked again; when it was killed."""
        try:
            runfile.check_running(run, path)  # again, right before the kill
        except runfile.RunFileError as exc:
            raise DrillError(str(exc)) from None
        t0 = time.monotonic()
        os.kill(run.pid, signal.SIGKILL)
        self._wait(f"{run.replica_id} (pid {run.pid}) to die", lambda: not alive(run.pid))
        return t0

    def _restart(self, run: runfile.RunFile, path: Path, kind: str, name: str) -> None:
        """Start the killed process again, exactly as its run file says."""
        log = Path(tempfile.gettempdir()) / f"loraplane-{run.replica_id}.log"
        self.report.restarted = {kind: name, "run_file": str(path), "cwd": run.cwd,
                                 "argv": list(run.argv), "log": str(log)}
        try:
            with log.open("ab") as err:
                subprocess.Popen(list(run.argv), cwd=run.cwd, stdout=subprocess.DEVNULL,
                                 stderr=err, start_new_session=True)
        except OSError as exc:
            raise DrillError(f"{kind} {name} was killed but could not be restarted ({exc}); "
                             f"restart it yourself: cd {shlex.quote(run.cwd)} && "
                             f"{shlex.join(run.argv)}") from None

    def _instance(self, data_dir: Path) -> tuple[runfile.RunFile, Path]:
        """The run file of the statesvc instance serving `data_dir`, checked: it runs, and
        --state names it and at least one other instance to carry on."""
        path = data_dir / runfile.RUN_FILE
        try:
            run = runfile.read(path)
            if run.replica_id != runfile.STATESVC_RUN_ID:
                raise runfile.RunFileError(f"{path} is the run file of replica "
                                           f"{run.replica_id}, not of a statesvc")
            runfile.check_running(run, path)
        except runfile.RunFileError as exc:
            raise DrillError(str(exc)) from None
        addresses = split_addresses(self.state)
        if run.listen not in addresses or len(addresses) < 2:
            raise DrillError(f"the statesvc of {data_dir} listens at {run.listen}; --state must "
                             "name it and another instance of the same log (--state a,b), "
                             f"not {self.state}")
        return run, path

    def _kill_statesvc(self, run: runfile.RunFile, path: Path, live: dict[str, str]) -> None:
        """SIGKILL the instance; every live replica must be ACTIVE at the head through the
        others (listed there by its heartbeats); then restart it and wait for its answer."""
        others = ",".join(a for a in split_addresses(self.state) if a != run.listen)
        t0 = self._kill(run, path)

        def through_others() -> bool:
            head = int(_call(others, "status", keys=self.keys)["head_seq"])
            listed: dict[str, Any] = {}
            for address in others.split(","):
                try:
                    listed.update({r["id"]: r for r in _call(
                        address, "status", timeout=3.0, keys=self.keys)["replicas"]})
                except (Unavailable, RemoteError):
                    continue
            for rid in live:
                self.progress(f"{rid} via others", listed.get(rid, {}).get("applied_seq", 0),
                              head)
            return all(listed.get(rid, {}).get("state") == "ACTIVE"
                       and listed[rid]["applied_seq"] >= head for rid in live)

        self._wait("every live replica ACTIVE through the other instances", through_others)
        self.report.timings["statesvc_kill_to_active_s"] = round(time.monotonic() - t0, 3)
        for rid in live:
            self._check(rid, "active without the killed statesvc", True, True,
                        f"heartbeats ACTIVE at the head to {others}")
        self._restart(run, path, "statesvc", run.listen)
        self._wait(f"statesvc at {run.listen} to answer again",
                   lambda: _status(run.listen, self.keys) is not None)

    def _settled(self, addresses: dict[str, str]) -> tuple[int, dict[str, dict[str, Any]]]:
        """Every replica's status at one common applied seq (the log may move meanwhile)."""
        for _ in range(50):
            head = int(_call(self.state, "status", keys=self.keys)["head_seq"])
            self._wait("every replica to reach the head", lambda: all(
                (s := self._status(a)) is not None and s["applied_seq"] >= head
                and s["pool_digest"] != "pending" for a in addresses.values()))
            statuses = {rid: self._status(a) for rid, a in addresses.items()}
            seqs = {s["applied_seq"] for s in statuses.values() if s}
            if len(seqs) == 1 and None not in statuses.values():
                return seqs.pop(), statuses  # type: ignore[return-value]
        raise DrillError("the log kept moving: replicas never stood at one seq")

    def _compare(self, addresses: dict[str, str]) -> None:
        seq, statuses = self._settled(addresses)
        self.report.head_seq = seq
        expected = _call(self.state, "digest", {"seq": seq}, keys=self.keys)["digest"]
        ref = statuses[ZERO]
        with ControlClient(self.state, retries=0, keys=self.keys) as c:
            listed = list_adapters(c)[1]
        adapters = [None, *sorted(a["name"] for a in listed)]
        # a replica without an engine (--no-inference) reports `inference` null: not probed
        pool_only = {rid for rid, s in statuses.items() if "inference" in s
                     and s["inference"] is None}
        probed = {rid: [] if rid in pool_only else
                  adapters if not self.resident_only or addr in self.fresh else
                  [None, *sorted({h["name"] for h in (statuses[rid].get("slots") or {}).values()
                                  if h["name"] in adapters})]
                  for rid, addr in addresses.items()}
        probes = {rid: self._probe(addr, probed[rid], seq) for rid, addr in addresses.items()}
        # after the probes, which filled slots: what each replica holds now
        resident = {rid: self._status(addr) or {} for rid, addr in addresses.items()}
        pinned = sorted(a["name"] for a in listed if a["pinned"])
        for rid, s in statuses.items():
            self._check(rid, "logical_digest", expected, s["logical_digest"],
                        "differs from statesvc's at this seq")
            self._check_resident(rid, resident[rid], resident[ZERO], pinned)
            if self.resident_only and addresses[rid] not in self.fresh:
                self._check(rid, "no_fills", _misses(s), _misses(resident[rid]),
                            "the probes filled slots (an adapter left its slot meanwhile)")
            if rid in pool_only:
                self.report.checks.append(Check(rid, "probes", True, detail=POOL_ONLY))
            for adapter in probed[rid]:
                label = f"probe:{adapter or '(base)'}"
                self._check(rid, label, probes[ZERO][adapter], probes[rid][adapter],
                            "greedy output differs from the replay from seq 0")

    def _check_resident(self, rid: str, status: dict[str, Any], ref: dict[str, Any],
                        pinned: list[str]) -> None:
        """Each slot's contents equal the from-zero replica's for the same adapter version,
        and every pinned adapter is resident."""
        def by_version(st: dict[str, Any]) -> dict[tuple[str, int], tuple[str, Any]]:
            return {(h["name"], h["version"]): (slot, h["digest"])
                    for slot, h in (st.get("slots") or {}).items()}
        mine, theirs = by_version(status), by_version(ref)
        wrong = sorted(f"{slot} ({name} v{version})" for (name, version), (slot, d)
                       in mine.items() if (name, version) in theirs
                       and theirs[(name, version)][1] != d)
        self._check(rid, "resident", [], wrong, f"slot(s) {', '.join(wrong)} differ from the "
                    "replay from seq 0")
        held = sorted({name for name, _ in mine})
        self._check(rid, "pinned", pinned, [p for p in pinned if p in held],
                    "pinned adapters are not resident")

    def _probe(self, address: str, adapters: list[str | None], seq: int
               ) -> dict[str | None, Any]:
        out: dict[str | None, Any] = {}
        for adapter in adapters:
            try:
                res = _call(address, GENERATE, generate_args(PROBE, adapter=adapter,
                                                             max_new_tokens=PROBE_TOKENS,
                                                             min_seq=seq), timeout=120.0,
                            keys=None if address in self.fresh else self.replica_keys)
                out[adapter] = res["output_ids"]
            except (RemoteError, Unavailable) as exc:
                out[adapter] = f"error: {exc}"
        return out

    def _check(self, rid: str, what: str, expected: Any, got: Any, why: str) -> None:
        ok = expected == got
        self.report.checks.append(Check(rid, what, ok, expected, got, "" if ok else why))
        self.report.ok &= ok


def _misses(status: dict[str, Any]) -> Any:
    """The slot fills a replica's requests caused so far (its `residency.misses`)."""
    return (status.get("residency") or {}).get("misses")
