"""Several statesvc instances on one PostgreSQL log (real server, real subprocesses): seqs
gapless and committed in seq order while they race, idempotency and --expect-head across
instances, any instance serving any blob, every instance publishing every event in order."""
from __future__ import annotations

import hashlib
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import psycopg
import pytest
import zmq

from shared.client import ControlClient, RemoteError, new_event_id
from statesvc.tools.example import ExampleAssets
from testkit.fleet import BIN, Computed, StateSvc, wait_for
from testkit.pg import PgServer

WRITERS, PAIRS = 4, 12  # clients, and load+unload pairs each: 1 + 4 * 24 events


def call(svc: StateSvc, cmd: str, **args: Any) -> Any:
    with ControlClient(svc.control) as c:
        return c.call(cmd, args)


def write(svc: StateSvc, cmd: str, **args: Any) -> Any:
    return call(svc, cmd, event_id=new_event_id(), **args)


def init(svc: StateSvc, example: ExampleAssets) -> None:
    write(svc, "pool.init", model=str(example.model_dir), max_loras=2, max_rank=16,
          targets="all")


def subscribe(svc: StateSvc) -> zmq.Socket[Any]:
    """A diff subscriber whose subscription is live (it has seen a heartbeat)."""
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(svc.publish)
    assert sub.poll(10_000) and sub.recv_multipart()[0] == b"hb"
    return sub


def diff_seqs(sub: zmq.Socket[Any], until: int) -> list[int]:
    seqs: list[int] = []
    deadline = time.monotonic() + 30
    while (not seqs or seqs[-1] < until) and time.monotonic() < deadline:
        if sub.poll(500):
            topic, frame = sub.recv_multipart()
            if topic == b"diff":
                seqs.append(msgpack.unpackb(frame)["seq"])
    return seqs


def test_two_instances_race_and_a_reader_following_by_seq_never_skips(
        two: tuple[StateSvc, StateSvc], example: ExampleAssets, pg_url: str) -> None:
    """The Marten bug: appends through two instances race while a reader follows the log by
    seq; no seq is skipped or seen out of order, every acknowledged event is in the log exactly
    once, and each instance publishes every event (the other's too) in seq order."""
    a, b = two
    subs = [subscribe(a), subscribe(b)]
    init(a, example)
    acked: list[tuple[int, str]] = []
    errors: list[BaseException] = []
    seen: list[int] = []
    writing = threading.Event()
    writing.set()

    def writer(svc: StateSvc, k: int) -> None:
        try:
            with ControlClient(svc.control) as c:
                for _ in range(PAIRS):
                    for cmd, extra in (("load", {"path": str(example.adapter_dirs["all-r2"])}),
                                       ("unload", {})):
                        eid = new_event_id()
                        res = c.call(cmd, {"event_id": eid, "name": f"w{k}", **extra})
                        acked.append((res["seq"], eid))
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    def reader() -> None:
        # committed rows only, as any follower sees them: polled as fast as it can
        with psycopg.connect(pg_url.replace("+psycopg", ""), autocommit=True) as conn:
            while writing.is_set() or len(seen) < 1 + WRITERS * PAIRS * 2:
                last = seen[-1] if seen else 0
                rows = conn.execute("SELECT seq FROM events WHERE seq > %s ORDER BY seq",
                                    (last,)).fetchall()
                for (seq,) in rows:
                    if seq != (seen[-1] if seen else 0) + 1:
                        errors.append(AssertionError(f"reader saw seq {seq} after {seen[-1:]}"))
                        return
                    seen.append(seq)

    threads = [threading.Thread(target=writer, args=(svc, k))
               for k, svc in enumerate([a, b] * (WRITERS // 2))]
    follow = threading.Thread(target=reader)
    follow.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    writing.clear()
    follow.join(60)
    assert not errors, errors
    total = 1 + WRITERS * PAIRS * 2
    assert seen == list(range(1, total + 1))
    assert sorted(seq for seq, _ in acked) == list(range(2, total + 1))  # each exactly once
    with psycopg.connect(pg_url.replace("+psycopg", "")) as conn:
        logged = dict(conn.execute("SELECT seq, event_id FROM events").fetchall())
    assert all(logged[seq] == eid for seq, eid in acked)
    for sub in subs:  # both instances published all of it, in seq order
        try:
            assert diff_seqs(sub, total) == list(range(1, total + 1))
        finally:
            sub.close(0)
    wait_for(lambda: call(a, "status")["head_seq"] == call(b, "status")["head_seq"] == total,
             what="both instances at the head")
    assert call(a, "status")["digest"] == call(b, "status")["digest"]


def test_idempotency_expect_head_and_blobs_across_instances(
        two: tuple[StateSvc, StateSvc], example: ExampleAssets) -> None:
    a, b = two
    init(a, example)
    adapter = example.adapter_dirs["attn-qv-r8"]
    eid = new_event_id()
    first = call(a, "load", event_id=eid, name="x", path=str(adapter))
    assert call(b, "load", event_id=eid, name="x", path=str(adapter)) == first  # a retry
    assert first["seq"] == 2 and call(b, "status")["head_seq"] == 2
    # the same new event_id through both at once: recorded once, both answer its seq
    eid, answers = new_event_id(), []
    racers = [threading.Thread(target=lambda s=s: answers.append(
        call(s, "load", event_id=eid, name="y", path=str(adapter)))) for s in (a, b)]
    for t in racers:
        t.start()
    for t in racers:
        t.join(30)
    assert [r["seq"] for r in answers] == [3, 3] and call(a, "status")["head_seq"] == 3
    # --expect-head holds across instances
    assert write(b, "unload", name="y", expect_head=3)["seq"] == 4
    with pytest.raises(RemoteError) as stale:
        write(a, "unload", name="x", expect_head=3)
    assert stale.value.code == "conflict" and "head is at seq 4" in str(stale.value)
    # the blob loaded through a is served by b, in chunks, from the database
    original = (adapter / "adapter_model.safetensors").read_bytes()
    sha = hashlib.sha256(original).hexdigest()
    got = b""
    while len(got) < len(original):
        chunk = call(b, "blob", sha256=sha, offset=len(got), length=100_000)
        assert chunk["size"] == len(original)
        got += chunk["data"]
    assert got == original
    with pytest.raises(RemoteError) as missing:
        call(b, "blob", sha256="0" * 64)
    assert missing.value.code == "not_found"


def test_an_unreachable_database_is_refused_with_the_fix(tmp_path: Path) -> None:
    res = subprocess.run([str(BIN / "statesvc"), "serve", "--data-dir", str(tmp_path), "--db",
                          "postgresql+psycopg://nobody:secret@127.0.0.1:9/none"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0
    assert "cannot open the event store" in res.stderr and "PostgreSQL runs there" in res.stderr
    assert "secret" not in res.stderr  # the password is not shown


def test_an_idle_instance_publishes_the_others_events_also_after_losing_its_listener(
        two: tuple[StateSvc, StateSvc], example: ExampleAssets, pg_url: str) -> None:
    """b receives no command: it learns of a's events from the log (NOTIFY as a doorbell, then
    read by seq) and publishes them in order, also when its LISTEN connection was cut and the
    notices sent meanwhile were lost."""
    a, b = two
    sub = subscribe(b)
    try:
        init(a, example)
        write(a, "load", name="x", path=str(example.adapter_dirs["all-r2"]))
        assert diff_seqs(sub, 2) == [1, 2]
        with psycopg.connect(pg_url.replace("+psycopg", ""), autocommit=True) as conn:
            cut = conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                               "WHERE query LIKE 'LISTEN%'").fetchall()
        assert len(cut) == 2  # each instance's doorbell
        write(a, "unload", name="x")
        write(a, "load", name="x", path=str(example.adapter_dirs["all-r2"]))
        assert diff_seqs(sub, 4) == [3, 4]
        wait_for(lambda: call(b, "status")["head_seq"] == 4, what="b at the head")
    finally:
        sub.close(0)


def test_replicas_on_either_instance_converge(two: tuple[StateSvc, StateSvc],
                                              example: ExampleAssets, tmp_path: Path) -> None:
    """A replica following b applies what was written through a, fetching the weights from
    b (out of the database), and both replicas end at one digest, statesvc's."""
    a, b = two
    replicas = [Computed(example.model_dir, svc, tmp_path / "replicas" / name, replica_id=name,
                         extra_args=("--no-warmup", "--no-inference"))
                for name, svc in (("ra", a), ("rb", b))]
    try:
        for r in replicas:
            r.start()
        init(a, example)
        write(a, "load", name="x", path=str(example.adapter_dirs["attn-qv-r8"]))
        write(b, "load", name="y", path=str(example.adapter_dirs["mlp-only-r16"]))
        write(a, "unload", name="x")
        digest = call(a, "status")["digest"]
        assert call(b, "status")["digest"] == digest

        def converged() -> bool:
            return all(r.status()["applied_seq"] == 4 and r.status()["state"] == "ACTIVE"
                       for r in replicas)

        wait_for(converged, what="both replicas at seq 4")
        assert {r.status()["logical_digest"] for r in replicas} == {digest}
    finally:
        for r in replicas:
            r.stop()


def test_migrate_upgrades_a_postgresql_database_to_head(tmp_path: Path, pg_url: str) -> None:
    for _ in range(2):  # the second run finds it at head
        res = subprocess.run([str(BIN / "statesvc"), "migrate", "--data-dir", str(tmp_path),
                              "--db", pg_url], capture_output=True, text=True, timeout=60)
        assert res.returncode == 0 and "schema is at head" in res.stdout, res.stderr
    with psycopg.connect(pg_url.replace("+psycopg", "")) as conn:
        assert conn.execute("SELECT version_num FROM alembic_version").fetchall() == [("0002",)]
        tables = {r[0] for r in conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}
    assert {"events", "snapshots", "blobs", "blob_chunks"} <= tables


def test_statesvc_rides_out_postgresql_restarting_in_immediate_mode(
        tmp_path: Path, example: ExampleAssets) -> None:
    """While PostgreSQL is down a command is answered storage_error (statesvc keeps running);
    after PostgreSQL restarts from its crash recovery, the retried command is recorded once
    and every acknowledged event is there."""
    if PgServer.missing():
        pytest.skip(PgServer.missing())
    server = PgServer().start()  # its own: this test stops it
    svc = StateSvc(tmp_path / "a", extra_args=("--db", server.database()))
    try:
        svc.start()
        init(svc, example)
        write(svc, "load", name="x", path=str(example.adapter_dirs["all-r2"]))
        server.halt()  # immediate mode: no shutdown checkpoint, crash recovery at start
        eid = new_event_id()
        with pytest.raises(RemoteError) as down:
            call(svc, "unload", event_id=eid, name="x")
        assert down.value.code == "storage_error" and svc.running
        server.start()

        def recorded() -> bool:
            try:
                return call(svc, "unload", event_id=eid, name="x")["seq"] == 3
            except RemoteError as exc:  # until the pool's connections are back
                assert exc.code == "storage_error"
                return False

        wait_for(recorded, what="the unload recorded after the restart")
        assert call(svc, "unload", event_id=eid, name="x")["seq"] == 3  # a retry: once
        assert call(svc, "status")["head_seq"] == 3
        assert [e["type"] for e in call(svc, "events", since=0, limit=10)["events"]] == [
            "pool.configured", "adapter.loaded", "adapter.unloaded"]
    finally:
        svc.stop()
        server.stop()
