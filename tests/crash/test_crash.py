"""SIGKILL in the middle of a burst of writes, then restart on the same data dir.

Several clients load and unload adapters as fast as the service answers; once
some hundreds of events are acknowledged statesvc is killed (-9), stray blob
files are planted, and it is started again. Every acknowledged event must be in
the log exactly once, the log must have no gaps, every blob an event names must
be there and hash to its name, a command whose answer was lost must be recorded
at most once when retried with its event_id, and the state must come back the
same on every restart.
"""
from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import pytest

from shared.client import ControlClient, Unavailable, new_event_id
from shared.events import Event
from shared.reducer import State, apply, logical_digest
from statesvc.tools.example import ExampleAssets
from testkit.fleet import StateSvc

CLIENTS = 4
NAMES_PER_CLIENT = 3
KILL_AFTER_ACKS = 300
WAIT_S = 60.0  # a guard against hanging, never a pass/fail threshold
EVENT_TYPE = {"load": "adapter.loaded", "unload": "adapter.unloaded"}


def command(index: int, step: int, adapter_dirs: list[Path]) -> tuple[str, dict[str, Any]]:
    """Client `index`'s command number `step`: load n0..n2, unload n0..n2, repeat."""
    name = f"c{index}-n{step % NAMES_PER_CLIENT}"
    args = {"event_id": new_event_id(), "name": name}
    if (step // NAMES_PER_CLIENT) % 2 == 0:
        path = adapter_dirs[(index + step) % len(adapter_dirs)]
        return "load", {**args, "path": str(path)}
    return "unload", args


@dataclass
class Acked:
    event_id: str
    cmd: str
    args: dict[str, Any]
    result: dict[str, Any]


@dataclass
class Writer:
    """One client: load n0..n2, unload n0..n2, repeat; each command appends one event."""

    index: int
    control: str
    adapter_dirs: list[Path]
    killed: threading.Event
    acked: list[Acked] = field(default_factory=list)
    pending: tuple[str, dict[str, Any]] | None = None  # sent, never acknowledged
    error: BaseException | None = None

    def command(self, step: int) -> tuple[str, dict[str, Any]]:
        return command(self.index, step, self.adapter_dirs)

    def run(self) -> None:
        try:
            with ControlClient(self.control, timeout_s=0.5, retries=0) as client:
                step = 0
                while True:
                    cmd, args = self.command(step)
                    while True:
                        try:
                            result = client.call(cmd, args)
                            break
                        except Unavailable:
                            if self.killed.is_set():
                                self.pending = (cmd, args)
                                return
                            # Slow, not dead: resend with the same event_id (recorded once).
                    self.acked.append(Acked(args["event_id"], cmd, args, result))
                    step += 1
        except BaseException as exc:  # surfaced by the test thread
            self.error = exc


@dataclass(frozen=True)
class Row:
    seq: int
    event_id: str
    type: str
    payload: dict[str, Any]
    recorded_at: str
    actor: str


def read_db(data_dir: Path) -> tuple[list[Row], dict[str, int], dict[int, str]]:
    """Events, blob rows (sha -> size) and snapshot digests, straight from the SQLite file."""
    db = sqlite3.connect(f"file:{data_dir / 'state.db'}?mode=ro", uri=True)
    try:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        rows = [Row(seq, eid, typ, json.loads(payload), at, actor) for seq, eid, typ, payload, at,
                actor in db.execute("SELECT seq, event_id, type, payload, recorded_at, actor "
                                    "FROM events ORDER BY seq")]
        blobs = dict(db.execute("SELECT sha256, size FROM blobs"))
        snapshots = dict(db.execute("SELECT seq, digest FROM snapshots"))
    finally:
        db.close()
    return rows, blobs, snapshots


def events_via_socket(client: ControlClient) -> tuple[int, list[dict[str, Any]]]:
    out: list[dict[str, Any]] = []
    while True:
        page = client.call("events", {"since": out[-1]["seq"] if out else 0})
        if not page["events"]:
            return page["head_seq"], out
        out += page["events"]


def replay_digests(rows: list[Row]) -> list[str]:
    """The logical digest after each event (index seq - 1), by the shared reducer alone."""
    state, digests = State(), []
    for r in rows:
        state = apply(state, r.seq, Event(r.seq, r.event_id, r.type, r.payload, r.recorded_at,
                                          r.actor).body)
        digests.append(logical_digest(state))
    return digests


@pytest.fixture
def svc(tmp_path: Path) -> Iterator[StateSvc]:
    svc = StateSvc(tmp_path / "data")
    try:
        yield svc
    finally:
        svc.stop()  # by pid, whatever state the test left it in


def test_sigkill_mid_burst_loses_nothing_acknowledged(svc: StateSvc,
                                                      example: ExampleAssets) -> None:
    data = svc.data_dir
    svc.start()
    pool_event = new_event_id()
    with ControlClient(svc.control, timeout_s=20, retries=0) as c:
        c.call("pool.init", {"event_id": pool_event, "model": str(example.model_dir),
                             "max_loras": 64, "max_rank": 32, "targets": "all"})

    # ---- the burst, and the kill --------------------------------------------------
    killed = threading.Event()
    writers = [Writer(i, svc.control, list(example.adapter_dirs.values()), killed)
               for i in range(CLIENTS)]
    threads = [threading.Thread(target=w.run, daemon=True) for w in writers]
    try:
        for t in threads:
            t.start()
        while sum(len(w.acked) for w in writers) < KILL_AFTER_ACKS:
            errors = [w.error for w in writers if w.error is not None]
            assert not errors, errors
            assert svc.proc is not None and svc.proc.poll() is None, "statesvc died on its own"
            time.sleep(0.01)
        # One more command whose answer its client then loses: recorded, never acknowledged.
        lost_answer = {"event_id": new_event_id(), "name": "lost-answer",
                       "path": str(example.adapter_dirs[next(iter(example.adapter_dirs))])}
        with ControlClient(svc.control, timeout_s=20, retries=0) as c:
            lost_result = c.call("load", lost_answer)
        killed.set()
        svc.kill()
    finally:
        killed.set()
        for t in threads:
            t.join(WAIT_S)
    assert not any(t.is_alive() for t in threads)
    for w in writers:
        if w.error is not None:
            raise w.error
    acked = [a for w in writers for a in w.acked]
    assert len(acked) >= KILL_AFTER_ACKS
    pending = [w.pending for w in writers if w.pending is not None]
    assert len(pending) == CLIENTS  # each writer stopped on an unanswered command

    # The crash left a write-ahead log behind (its frames may hold acknowledged events).
    wal = data / "state.db-wal"
    assert wal.is_file() and wal.stat().st_size > 0

    # Stray blob files no event names, as a crash between blob and event leaves them.
    stray = data / "blobs" / "ab" / ("ab" + "0" * 62)
    stray.parent.mkdir(exist_ok=True)
    stray.write_bytes(b"orphan")
    half_written = data / "blobs" / "tmp" / f"{'cd' * 32}.12345"
    half_written.write_bytes(b"half a blob")

    # ---- restart on the same data dir ---------------------------------------------
    svc.start()
    assert not stray.exists() and not half_written.exists()

    rows, blob_rows, snapshots = read_db(data)
    assert [r.seq for r in rows] == list(range(1, len(rows) + 1))
    by_id = {r.event_id: r for r in rows}
    assert len(by_id) == len(rows)

    with ControlClient(svc.control, timeout_s=20, retries=0) as c:
        head, wire = events_via_socket(c)
        assert head == len(rows)
        assert [(e["seq"], e["event_id"], e["type"], e["payload"]) for e in wire] == \
            [(r.seq, r.event_id, r.type, r.payload) for r in rows]

        # Every acknowledged event is there once, at the seq its client was told.
        assert by_id[pool_event].seq == 1
        for a in acked:
            row = by_id.get(a.event_id)
            assert row is not None, f"acknowledged {a.cmd} {a.args['name']} (seq " \
                f"{a.result['seq']}) is not in the log"
            assert (row.seq, row.type, row.payload["name"]) == \
                (a.result["seq"], EVENT_TYPE[a.cmd], a.args["name"])
            assert row.payload["version"] == a.result["version"]
        # Nothing else is: the only unacknowledged events are the writers' last commands.
        known = {pool_event, lost_answer["event_id"]} | {a.event_id for a in acked} | \
            {p[1]["event_id"] for p in pending}
        assert set(by_id) <= known

        # Every blob an event names is stored, has its row, and hashes to its name.
        stored = {p.name for p in (data / "blobs").glob("??/*")}
        loaded = {r.payload["sha256"]: r.payload["size"] for r in rows
                  if r.type == "adapter.loaded"}
        assert loaded and set(loaded) <= stored
        for sha, size in loaded.items():
            assert hashlib.sha256((data / "blobs" / sha[:2] / sha).read_bytes()).hexdigest() == sha
            assert blob_rows[sha] == size
        assert stored == set(blob_rows)  # and no file without its row survives the start

        # Retrying a lost answer with its event_id records it at most once.
        for cmd, args in pending:
            before = by_id.get(args["event_id"])
            head_before = c.call("list")["head_seq"]
            first = c.call(cmd, args)
            again = c.call(cmd, args)
            assert first == again
            head_after = c.call("list")["head_seq"]
            if before is not None:  # recorded before the kill: answered from the log
                assert first["seq"] == before.seq and head_after == head_before
            else:  # lost with the process: recorded now, once
                assert first["seq"] == head_before + 1 and head_after == head_before + 1
        head_before = c.call("list")["head_seq"]
        assert c.call("load", lost_answer) == lost_result
        assert c.call("list")["head_seq"] == head_before
        # Retrying an acknowledged command answers the original result and appends nothing.
        head_before = c.call("list")["head_seq"]
        for w in writers:
            for a in w.acked[:1] + w.acked[-1:]:
                assert c.call(a.cmd, a.args) == a.result
        assert c.call("list")["head_seq"] == head_before
        rows, _, snapshots = read_db(data)
        ids = [r.event_id for r in rows]
        for args in [lost_answer, *(p[1] for p in pending)]:
            assert ids.count(args["event_id"]) == 1

        # The state is a pure function of the log: the service's digest, the snapshots and
        # a replay by the shared reducer agree.
        replayed = replay_digests(rows)
        status = c.call("status")
        assert (status["head_seq"], status["digest"]) == (len(rows), replayed[-1])
        assert snapshots, "expected snapshots in a log this long"
        for seq, digest in snapshots.items():
            assert replayed[seq - 1] == digest
        for seq in (1, len(rows) // 2, len(rows)):
            assert c.call("digest", {"seq": seq})["digest"] == replayed[seq - 1]

    # Restarting (cleanly, twice) comes back to the same head and digest.
    for _ in range(2):
        svc.stop()
        svc.start()
        with ControlClient(svc.control, timeout_s=20, retries=0) as c:
            again = c.call("status")
        assert (again["head_seq"], again["digest"]) == (status["head_seq"], status["digest"])
    assert read_db(data)[0] == rows
