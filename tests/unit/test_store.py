"""The event store contract, one subclass per backend (SQLite, PostgreSQL)."""
from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path
from typing import Iterator

import psycopg
import pytest
from sqlalchemy import create_engine, exc, text
from sqlalchemy.exc import IntegrityError

from shared.config import MAX_BLOB_CHUNK
from statesvc.persistence.base import EventStore, HeadMoved, NewBlob, NewEvent, Snapshot
from statesvc.persistence.postgres import CHANNEL, Doorbell, PostgresEventStore
from statesvc.persistence.postgres_blobs import CHUNK_BYTES, LogBlobStore
from statesvc.persistence.sqlite import SqliteEventStore, sqlite_url
from statesvc.service import StateService
from statesvc.tools.example import ExampleAssets
from testkit.inproc import call, init_pool


def ev(seq: int, event_id: str | None = None) -> NewEvent:
    return NewEvent(seq, event_id or f"00000000-0000-4000-8000-{seq:012d}", "adapter.loaded",
                    {"name": f"a{seq}", "n": seq}, "tester")


class EventStoreContract:
    def make_store(self, tmp_path: Path) -> EventStore:
        raise NotImplementedError

    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[EventStore]:
        s = self.make_store(tmp_path)
        yield s
        s.close()

    def test_log_is_append_only(self, tmp_path: Path) -> None:
        store = self.make_store(tmp_path)
        store.append([ev(1)])
        for sql in ("UPDATE events SET type = 'x'", "DELETE FROM events"):
            with pytest.raises(IntegrityError, match="append-only"):
                with store.engine.begin() as conn:  # type: ignore[attr-defined]
                    conn.execute(text(sql))
        assert [e.type for e in store.read(0, 10)] == ["adapter.loaded"]
        store.close()

    def test_reopen_keeps_everything(self, tmp_path: Path) -> None:
        store = self.make_store(tmp_path)
        store.append([ev(1), ev(2)], snapshots=[Snapshot(2, b"s", "d")])
        store.close()
        again = self.make_store(tmp_path)  # migrations run again: a no-op at head
        assert again.head() == 2 and again.latest_snapshot() == Snapshot(2, b"s", "d")
        again.close()

    def test_empty(self, store: EventStore) -> None:
        assert store.head() == 0
        assert store.read(0, 10) == []
        assert store.latest_snapshot() is None
        assert store.blob_hashes() == set()

    def test_append_and_read_in_order(self, store: EventStore) -> None:
        stored = store.append([ev(1), ev(2)])
        store.append([ev(3)])
        assert store.head() == 3
        got = store.read(0, 10)
        assert [e.seq for e in got] == [1, 2, 3]
        assert got[:2] == stored
        assert got[0].payload == {"name": "a1", "n": 1} and got[0].actor == "tester"
        assert [e.seq for e in store.read(1, 1)] == [2]
        assert [e.seq for e in store.read(0, 10, until=2)] == [1, 2]

    def test_event_ids_are_unique(self, store: EventStore) -> None:
        store.append([ev(1, "00000000-0000-4000-8000-00000000000a")])
        with pytest.raises(IntegrityError):
            store.append([ev(2, "00000000-0000-4000-8000-00000000000a")])
        assert store.head() == 1

    def test_seqs_are_unique(self, store: EventStore) -> None:
        store.append([ev(1)])
        # a shared log (PostgreSQL) refuses it before the insert: its head is not at seq 0
        with pytest.raises((IntegrityError, HeadMoved)):
            store.append([ev(1, "00000000-0000-4000-8000-0000000000ff")])
        assert store.head() == 1

    def test_a_batch_is_all_or_nothing(self, store: EventStore) -> None:
        store.append([ev(1)])
        with pytest.raises(IntegrityError):
            store.append([ev(2), ev(3), ev(1, "00000000-0000-4000-8000-0000000000ff")],
                         blobs=[NewBlob("ab" * 32, 10, 2)])
        assert store.head() == 1 and store.blob_hashes() == set()

    def test_lookup_by_event_id(self, store: EventStore) -> None:
        store.append([ev(1), ev(2)])
        found = store.by_event_ids([ev(2).event_id, "00000000-0000-4000-8000-999999999999"])
        assert list(found) == [ev(2).event_id] and found[ev(2).event_id].seq == 2

    def test_snapshots_and_blobs(self, store: EventStore) -> None:
        store.append([ev(1), ev(2)], blobs=[NewBlob("ab" * 32, 10, 1)],
                     snapshots=[Snapshot(2, b"state-2", "d2")])
        store.append([ev(3)], blobs=[NewBlob("ab" * 32, 10, 3), NewBlob("cd" * 32, 5, 3)],
                     snapshots=[Snapshot(3, b"state-3", "d3")])
        assert store.latest_snapshot() == Snapshot(3, b"state-3", "d3")
        assert store.latest_snapshot(at_or_before=2) == Snapshot(2, b"state-2", "d2")
        assert store.latest_snapshot(at_or_before=1) is None
        assert store.blob_hashes() == {"ab" * 32, "cd" * 32}


class TestSqliteEventStore(EventStoreContract):
    def make_store(self, tmp_path: Path) -> SqliteEventStore:
        return SqliteEventStore(sqlite_url(tmp_path))

    def test_durability_pragmas(self, tmp_path: Path) -> None:
        store = self.make_store(tmp_path)
        with store.engine.begin() as conn:
            assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
            assert conn.execute(text("PRAGMA synchronous")).scalar() == 2  # FULL
        store.close()


class TestPostgresEventStore(EventStoreContract):
    """The same contract on a real PostgreSQL server (testkit/pg.py), one database per test."""

    @pytest.fixture(autouse=True)
    def _database(self, pg_url: str) -> None:
        self.url = pg_url

    def make_store(self, tmp_path: Path) -> PostgresEventStore:
        return PostgresEventStore(self.url)

    def test_durability_settings(self, tmp_path: Path) -> None:
        store = self.make_store(tmp_path)
        with store.engine.begin() as conn:
            for setting in ("fsync", "synchronous_commit", "full_page_writes"):
                assert conn.execute(text(f"SHOW {setting}")).scalar() == "on"
        store.close()

    def test_the_doorbell_rings_for_others_commits_and_foreign_notices(self, tmp_path: Path) -> None:
        """A notice at or below the instance's head needs no read; one beyond it does, and so
        does one that names no seq (anyone with the database can NOTIFY the channel): it is
        read as "read the log", never as an error."""
        store = self.make_store(tmp_path)
        bell = Doorbell(store._dsn)
        assert bell.fileno() is not None

        def rings(after: int) -> bool:
            """Whether a notice beyond `after` arrives (delivery to the listener is async)."""
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                if bell.rang(after):
                    return True
                time.sleep(0.05)
            return False

        store.append([ev(1)])
        time.sleep(0.3)
        assert not bell.rang(after=1)  # its own commit: nothing to read
        store.append([ev(2)])
        assert rings(after=1)  # a commit beyond this instance's head
        with psycopg.connect(store._dsn, autocommit=True) as other:
            other.execute("SELECT pg_notify(%s, %s)", (CHANNEL, "not a seq \u00e9"))
        assert rings(after=2)
        assert store.head() == 2  # nothing was written by the stray notice
        bell.close()
        store.close()

    def test_an_append_behind_the_head_writes_nothing(self, tmp_path: Path) -> None:
        """Another instance appended meanwhile: HeadMoved, and neither events nor blobs."""
        store = self.make_store(tmp_path)
        store.append([ev(1), ev(2)])
        with pytest.raises(HeadMoved) as moved:
            store.append([ev(2, "00000000-0000-4000-8000-0000000000ff")],
                         blobs=[NewBlob("ab" * 32, 3, 2, b"abc")])
        assert moved.value.head == 2
        with pytest.raises(HeadMoved):  # a gap is refused the same way
            store.append([ev(4)])
        assert store.head() == 2 and store.blob_hashes() == set()
        store.close()

    def test_a_turn_starts_with_the_new_events_and_the_recorded_ids(self, tmp_path: Path) -> None:
        """One round trip reads, under the turn's lock, what the batch needs: the events
        after the instance's head and those recorded under its event_ids; its append then
        commits after that head, and the turn is released with the commit."""
        other, store = self.make_store(tmp_path), self.make_store(tmp_path)
        other.append([ev(1), ev(2)])
        unknown = "00000000-0000-4000-8000-999999999999"
        with store.turn(1, [ev(2).event_id, unknown]) as begun:
            assert [e.seq for e in begun.events] == [2]
            assert list(begun.recorded) == [ev(2).event_id] and begun.recorded[ev(2).event_id].seq == 2
            store.append([ev(3)])
            assert _advisory_locks(other) == []  # committed: the turn is free
        with store.turn(3, [unknown]) as begun:  # nothing new, nothing recorded
            assert begun.events == [] and begun.recorded == {}
            assert len(_advisory_locks(other)) == 1
        assert _advisory_locks(other) == [] and store.head() == 3  # ended without an append
        with store.turn(0, []) as begun:  # no writes: it only reads, and takes no turn
            assert [e.seq for e in begun.events] == [1, 2, 3] and _advisory_locks(other) == []
        store.close()
        other.close()

    def test_a_turn_holds_off_the_other_writers_until_it_commits(self, tmp_path: Path) -> None:
        """While one instance holds the turn, another's append waits for it, then finds the
        head moved and writes nothing: seqs stay gapless and commit in seq order."""
        store, other = self.make_store(tmp_path), self.make_store(tmp_path)
        outcome: list[BaseException | None] = []

        def append_elsewhere() -> None:
            try:
                other.append([ev(1, "00000000-0000-4000-8000-0000000000ff")])
                outcome.append(None)
            except BaseException as err:  # noqa: BLE001 (the outcome is the assertion)
                outcome.append(err)

        with store.turn(0, [ev(1).event_id]):
            waiter = threading.Thread(target=append_elsewhere)
            waiter.start()
            deadline = time.monotonic() + 30
            while [granted for _, granted in _advisory_locks(store)] != [True, False]:
                assert time.monotonic() < deadline, "the other append never waited for the turn"
                time.sleep(0.02)
            store.append([ev(1)])
        waiter.join()
        assert isinstance(outcome[0], HeadMoved) and outcome[0].head == 1
        assert [e.event_id for e in store.read(0, 10)] == [ev(1).event_id]
        store.close()
        other.close()

    def test_a_second_append_in_a_turn_takes_the_turn_again(self, tmp_path: Path) -> None:
        """A batch that commits twice (writes, a read, writes): the first commit ends the
        turn, so another instance may write in between; the second append takes the turn
        again, reads the head under it, and finds it moved, writing nothing."""
        store, other = self.make_store(tmp_path), self.make_store(tmp_path)
        with store.turn(0, [ev(1).event_id]):
            store.append([ev(1)])
            assert _advisory_locks(other) == []
            other.append([ev(2)])
            with pytest.raises(HeadMoved) as moved:
                store.append([ev(2, "00000000-0000-4000-8000-0000000000ff")])
            assert moved.value.head == 2 and _advisory_locks(other) == []
            store.append([ev(3)])
        assert [e.seq for e in other.read(0, 10)] == [1, 2, 3] and _advisory_locks(other) == []
        store.close()
        other.close()

    def test_a_connection_lost_between_turn_and_append_writes_nothing(self, tmp_path: Path) -> None:
        """The turn's transaction dies with its connection: the append fails as a lost
        connection does (retryable), nothing of it is written, the turn is free for the
        others, and the store's next turn, on a new connection, appends it once."""
        store = self.make_store(tmp_path)
        store.append([ev(1)])
        with pytest.raises(exc.OperationalError):
            with store.turn(1, [ev(2).event_id]) as begun:
                assert begun.recorded == {}
                _terminate(store)
                store.append([ev(2)], blobs=[NewBlob("ab" * 32, 3, 2, b"abc")])
        other = self.make_store(tmp_path)
        assert other.head() == 1 and other.blob_hashes() == set() and _advisory_locks(other) == []
        with store.turn(1, [ev(2).event_id]) as begun:
            assert begun.recorded == {}
            store.append([ev(2)])
        with store.turn(2, [ev(2).event_id]) as begun:  # a resend finds it recorded
            assert begun.recorded[ev(2).event_id].seq == 2
        assert [e.seq for e in other.read(0, 10)] == [1, 2]
        store.close()
        other.close()

    def test_event_id_lookups_are_planned_for_their_ids_whatever_the_logs_length(
            self, tmp_path: Path) -> None:
        """The event_id lookup (every batch's idempotency check) must use the event_id index
        at any log length. Prepared, PostgreSQL settled on a generic plan chosen while the log
        was small, a sequential scan, and every batch then read the whole log (bench_pg: 4
        clients lost a fifth of their rate with each 3,200 events). So it is never prepared
        on the store's connection, however often it runs, while the other reads are."""
        store = self.make_store(tmp_path)
        store.append([ev(i) for i in range(1, 41)])
        for i in range(12):  # psycopg prepares a statement on its 5th execution
            with store.turn(i, [ev(i + 1).event_id, "00000000-0000-4000-8000-00000000ffff"]
                            ) as begun:
                assert set(begun.recorded) == {ev(i + 1).event_id}
            assert set(store.by_event_ids([ev(i + 2).event_id])) == {ev(i + 2).event_id}
            store.read(i, 5)
        assert store._db is not None
        prepared = [r[0] for r in store._db.execute(
            "SELECT statement FROM pg_prepared_statements").fetchall()]
        assert any("WHERE seq >" in q for q in prepared), prepared  # the catch-up read is
        assert not [q for q in prepared if "event_id = ANY" in q], prepared
        store.close()

    def test_blobs_live_in_the_database(self, tmp_path: Path) -> None:
        store = self.make_store(tmp_path)
        data = bytes(range(256)) * (CHUNK_BYTES // 256 * 2 + 3)  # two chunks and a bit
        sha = hashlib.sha256(data).hexdigest()
        store.append([ev(1)], blobs=[NewBlob(sha, len(data), 1, data)])
        other = LogBlobStore(PostgresEventStore(self.url).engine)  # another instance
        assert other.has(sha) and other.size(sha) == len(data) and other.verify(sha)
        got = b"".join(other.read_chunk(sha, off, 700_001)
                       for off in range(0, len(data), 700_001))
        assert got == data and other.read_chunk(sha, len(data)) == b""
        assert other.all() == {sha} and not other.has("cd" * 32)
        other.engine.dispose()
        store.close()

    def test_blob_rows_read_again_come_from_memory(self, tmp_path: Path) -> None:
        """Every replica fetches a new blob right after its load: the second read of a row
        costs no query (LRU within cache_bytes); an evicted row is read from the database."""
        store = self.make_store(tmp_path)
        data = bytes(range(256)) * (CHUNK_BYTES // 256 * 3)  # three rows
        sha = hashlib.sha256(data).hexdigest()
        store.append([ev(1)], blobs=[NewBlob(sha, len(data), 1, data)])
        blobs = LogBlobStore(PostgresEventStore(self.url).engine, cache_bytes=2 * CHUNK_BYTES)
        assert blobs.read_chunk(sha, 0, len(data)) == data  # rows 1 and 2 stay
        db, blobs.engine = blobs.engine, create_engine("postgresql+psycopg://x@127.0.0.1:1/x")
        assert blobs.has(sha) and blobs.size(sha) == len(data)  # no database: from memory
        assert blobs.read_chunk(sha, CHUNK_BYTES + 5, len(data)) == data[CHUNK_BYTES + 5:]
        with pytest.raises(exc.OperationalError):
            blobs.read_chunk(sha, 0, 10)  # row 0 was evicted
        blobs.engine = db
        assert blobs.read_chunk(sha, 0, 10) == data[:10]
        db.dispose()
        store.close()

    def test_blob_read_errors_come_out_as_sqlalchemys(self, tmp_path: Path) -> None:
        """Rows are read in binary on the driver's own cursor: its errors are raised as
        SQLAlchemy's, like every other read's (the blob thread answers those), and the
        connection serves the next read."""
        store = self.make_store(tmp_path)
        data = b"rows" * 1000
        sha = hashlib.sha256(data).hexdigest()
        store.append([ev(1)], blobs=[NewBlob(sha, len(data), 1, data)])
        blobs = LogBlobStore(PostgresEventStore(self.url).engine)
        assert blobs.has(sha)
        with blobs.engine.begin() as conn:
            conn.execute(text("ALTER TABLE blob_chunks RENAME TO blob_chunks_away"))
        with pytest.raises(exc.ProgrammingError, match="blob_chunks"):
            blobs.read_chunk(sha, 0, 10)
        with blobs.engine.begin() as conn:
            conn.execute(text("ALTER TABLE blob_chunks_away RENAME TO blob_chunks"))
        assert blobs.read_chunk(sha, 0, len(data)) == data
        blobs.engine.dispose()
        store.close()


def _advisory_locks(store: PostgresEventStore) -> list[tuple[int, bool]]:
    """The advisory locks held or waited for on the store's database: (backend pid, granted)."""
    with psycopg.connect(store._dsn, autocommit=True) as db:
        return [(int(pid), bool(granted)) for pid, granted in db.execute(
            "SELECT pid, granted FROM pg_locks WHERE locktype = 'advisory' AND database = "
            "(SELECT oid FROM pg_database WHERE datname = current_database()) "
            "ORDER BY granted DESC, pid")]


def _terminate(store: PostgresEventStore) -> None:
    """Cut the store's held connection as PostgreSQL does when it restarts or its host goes."""
    assert store._db is not None
    with psycopg.connect(store._dsn, autocommit=True) as db:
        db.execute("SELECT pg_terminate_backend(%s)", (store._db.info.backend_pid,))


def test_a_blob_the_instance_committed_is_served_without_the_database(
        tmp_path: Path, pg_url: str, example: ExampleAssets) -> None:
    """The fleet fetches a new blob right after its load: the instance that committed it
    answers every chunk, the first one too, from memory (LogBlobStore.committed)."""
    store = PostgresEventStore(pg_url)
    service = StateService(store, LogBlobStore(store.engine))
    init_pool(service, example.model_dir)
    call(service, "load", name="a", path=str(example.adapter_dirs["attn-qv-r8"]))
    loaded = service.state.adapters["a"]
    sha, size = loaded.sha256, loaded.size
    db, service.blobs.engine = service.blobs.engine, create_engine(  # type: ignore[attr-defined]
        "postgresql+psycopg://x@127.0.0.1:1/x")  # no database from here on
    got = b"".join(call(service, "blob", sha256=sha, offset=off, length=MAX_BLOB_CHUNK)["data"]
                   for off in range(0, size, MAX_BLOB_CHUNK))
    assert hashlib.sha256(got).hexdigest() == sha and len(got) == size
    service.blobs.engine = db  # type: ignore[attr-defined]
    store.close()


def test_a_new_blob_on_disk_is_served_from_memory_until_evicted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """statesvc's file blob store (SQLite): a new blob is on disk when `put` returns, and its
    bytes are kept (RECENT_BYTES) for the fetches after its load; past the bound the oldest
    is read from its file again, and `remove` drops both."""
    import statesvc.persistence.sqlite as blobs_module
    from statesvc.persistence.sqlite import FileBlobStore
    monkeypatch.setattr(blobs_module, "RECENT_BYTES", 5000)
    store = FileBlobStore(tmp_path / "blobs")
    first, second = b"1" * 3000, b"2" * 3000
    sha1, created = store.put(first)
    assert created and store.path(sha1).read_bytes() == first
    store.path(sha1).write_bytes(b"x" * 3000)  # the file changes under the running service
    assert store.read_chunk(sha1, 0) == first and store.size(sha1) == 3000  # from memory
    sha2, _ = store.put(second)  # 6,000 bytes > 5,000: the first leaves memory
    assert store.read_chunk(sha1, 0) == b"x" * 3000  # from its file
    assert store.read_chunk(sha2, 1000, 10) == b"2" * 10
    store.remove(sha2)
    with pytest.raises(FileNotFoundError):
        store.read_chunk(sha2, 0)
    assert store.put(b"y" * 6000)[1] and store.size(hashlib.sha256(b"y" * 6000).hexdigest()) == 6000
