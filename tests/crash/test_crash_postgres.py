"""Two statesvc instances on one PostgreSQL log, four clients writing through both; one
instance SIGKILLed mid-burst, then PostgreSQL itself stopped in immediate mode (no shutdown
checkpoint: crash recovery at its start) and restarted, all while the clients write.

Clients name both instances (`a,b` or `b,a`) and resend every command with its event_id until
it is answered (through the other instance when theirs is gone, again after storage_error
while PostgreSQL is down), so every command sent is acknowledged once. Then: every
acknowledged event is in the log exactly once at the seq it was acknowledged with, the seqs
have no gaps, and two pool-only replicas following `a,b` and `b,a` converge with statesvc's
digest; the killed instance, restarted, agrees too.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import psycopg
import pytest

from shared.client import ControlClient, RemoteError, Unavailable, new_event_id
from statesvc.tools.example import ExampleAssets
from testkit.fleet import Computed, Endpoints, StateSvc, wait_for
from testkit.pg import PgServer
from tests.crash.test_crash import command as crash_command

CLIENTS = 4
KILL_AT, HALT_AT, STOP_AT = 60, 120, 180  # acknowledged commands before each step
WAIT_S = 120.0  # a guard against hanging, never a pass/fail threshold


@dataclass
class Writer:
    """One client: test_crash's commands (load n0..n2, unload n0..n2, ...), each one event."""

    index: int
    state: str  # a,b or b,a
    adapter_dirs: list[Path]
    stop: threading.Event
    acked: list[tuple[int, str]] = field(default_factory=list)  # (seq, event_id)
    retries: int = 0  # answers that were silence or storage_error, each resent
    error: BaseException | None = None

    def command(self, step: int) -> tuple[str, dict[str, Any]]:
        return crash_command(self.index, step, self.adapter_dirs)

    def run(self) -> None:
        try:
            with ControlClient(self.state, timeout_s=2.0, retries=0) as client:
                step = 0
                while not self.stop.is_set():
                    cmd, args = self.command(step)
                    deadline, last = time.monotonic() + WAIT_S, ""
                    while True:  # until answered: the same event_id, recorded once
                        assert time.monotonic() < deadline, f"{cmd} never answered: {last}"
                        try:
                            result = client.call(cmd, args)
                            break
                        except Unavailable as exc:
                            self.retries, last = self.retries + 1, str(exc)
                        except RemoteError as exc:
                            if exc.code != "storage_error":
                                raise
                            self.retries, last = self.retries + 1, str(exc)
                            time.sleep(0.05)
                    self.acked.append((int(result["seq"]), args["event_id"]))
                    step += 1
        except BaseException as exc:  # surfaced by the test thread
            self.error = exc


@pytest.fixture
def server() -> Iterator[PgServer]:
    """A PostgreSQL server of this test's own: it is stopped and restarted here."""
    why = PgServer.missing()
    if why is not None:
        pytest.skip(why)
    pg = PgServer()
    try:
        yield pg.start()
    finally:
        pg.stop()


def test_kill_one_instance_and_restart_postgresql_mid_burst(
        server: PgServer, example: ExampleAssets, tmp_path: Path) -> None:
    url = server.database()
    a = StateSvc(tmp_path / "a", extra_args=("--db", url))
    b = StateSvc(tmp_path / "b", extra_args=("--db", url))
    ab = Endpoints(f"{a.control},{b.control}", f"{a.publish},{b.publish}")
    ba = Endpoints(f"{b.control},{a.control}", f"{b.publish},{a.publish}")
    replicas = [Computed(example.model_dir, addrs, tmp_path / name, replica_id=name,
                         extra_args=("--no-warmup", "--no-inference"))
                for name, addrs in (("r-ab", ab), ("r-ba", ba))]
    stop = threading.Event()
    writers = [Writer(i, (ab if i % 2 == 0 else ba).control,
                      list(example.adapter_dirs.values()), stop) for i in range(CLIENTS)]
    threads = [threading.Thread(target=w.run, daemon=True) for w in writers]

    def acked() -> int:
        errors = [w.error for w in writers if w.error is not None]
        assert not errors, errors
        return sum(len(w.acked) for w in writers)

    try:
        a.start()
        b.start()
        for r in replicas:
            r.start()
        with ControlClient(a.control, timeout_s=20) as c:
            c.call("pool.init", {"event_id": new_event_id(), "model": str(example.model_dir),
                                 "max_loras": 64, "max_rank": 32, "targets": "all"})
        for t in threads:
            t.start()
        wait_for(lambda: acked() >= KILL_AT, timeout=WAIT_S, what=f"{KILL_AT} acks")
        a.kill()  # SIGKILL mid-burst: its clients move to b
        wait_for(lambda: acked() >= HALT_AT, timeout=WAIT_S, what=f"{HALT_AT} acks")
        server.halt()  # immediate mode, under load
        time.sleep(1.0)  # commands meanwhile: storage_error, resent
        server.start()  # crash recovery
        wait_for(lambda: acked() >= STOP_AT, timeout=WAIT_S, what=f"{STOP_AT} acks")
        stop.set()  # each writer finishes the command it has sent
        for t in threads:
            t.join(WAIT_S)
        assert not any(t.is_alive() for t in threads)
        check(writers, replicas, url, a, b)
    finally:
        stop.set()
        for r in replicas:
            r.stop()
        a.stop()
        b.stop()


def check(writers: list[Writer], replicas: list[Computed], url: str, a: StateSvc,
          b: StateSvc) -> None:
    assert sum(len(w.acked) for w in writers) >= STOP_AT
    for w in writers:
        if w.error is not None:
            raise w.error

    # ---- the log: every acknowledged event once, at its seq; no gaps ----------------
    with psycopg.connect(url.replace("+psycopg", "")) as conn:
        rows = conn.execute("SELECT seq, event_id FROM events ORDER BY seq").fetchall()
    seqs = [seq for seq, _ in rows]
    assert seqs == list(range(1, len(rows) + 1))
    logged: dict[int, str] = dict(rows)
    all_acked = [x for w in writers for x in w.acked]
    assert len({eid for _, eid in all_acked}) == len(all_acked)
    assert all(logged.get(seq) == eid for seq, eid in all_acked)
    # every command was answered before its writer stopped: nothing else is in the log
    assert len(rows) == 1 + len(all_acked)
    assert sum(w.retries for w in writers) > 0  # the kill and the restart were felt

    # ---- replicas converge; the killed instance, restarted, agrees -------------------
    a.start()
    head = len(rows)
    with ControlClient(b.control) as c:
        digest = c.call("status")["digest"]
    wait_for(lambda: all(r.status()["applied_seq"] == head and r.status()["state"] == "ACTIVE"
                         for r in replicas), timeout=WAIT_S, what="replicas at the head")
    assert {r.status()["logical_digest"] for r in replicas} == {digest}
    with ControlClient(a.control) as c:
        wait_for(lambda: c.call("status")["head_seq"] == head, what="a at the head again")
        assert c.call("status")["digest"] == digest
