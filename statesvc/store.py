"""The event store: the log, snapshots and blob rows behind a small interface.

`EventStore` is the interface, with two backends: `SqliteEventStore` (SQLAlchemy 2
over SQLite in WAL mode with synchronous=FULL, one writer, the default) and
`PostgresEventStore` (statesvc/pgstore.py: several statesvc instances on one database;
`open_store` picks by URL). `append` writes a whole batch of
events in one `BEGIN IMMEDIATE` transaction and returns only once it is durable,
so concurrent commands are committed together (group commit).

The write path (`append`, and `by_event_ids` once per batch) runs plain SQL on one
connection the store keeps checked out of the engine's pool: SQLAlchemy's
per-statement work cost more CPU than SQLite's commit. Its errors are raised as
SQLAlchemy's (IntegrityError, OperationalError, ...), like the rest of the store's.

A SQLite log also keeps a high-water mark (`HighWater`, state.db.head): the head after
its last commit. A log found behind it at open lost events (most likely its state.db-wal),
and is refused before anything is written to it.
"""
from __future__ import annotations

import json
import os
import re
import sqlite3
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Collection, Iterator, Protocol, Sequence

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event, exc, func, inspect, make_url, select, text

from shared.events import Event
from statesvc.models import BlobRow, EventRow, SnapshotRow

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


class StoreError(RuntimeError):
    """The store cannot be served as it is; the message says why and what to do. Nothing in
    it was changed."""


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


@dataclass(frozen=True)
class NewEvent:
    seq: int
    event_id: str
    type: str
    payload: dict[str, Any]
    actor: str


@dataclass(frozen=True)
class Snapshot:
    seq: int
    state: bytes  # canonical msgpack of the reduced state
    digest: str


@dataclass(frozen=True)
class NewBlob:
    sha256: str
    size: int
    first_seq: int
    # the bytes, where blobs live in the log (PostgreSQL): written in the events' transaction
    data: bytes | bytearray | None = field(default=None, compare=False, repr=False)


CATCH_UP_PAGE = 1000  # events read at a time when an instance catches up with a shared log


@dataclass(frozen=True)
class Begun:
    """What a batch knows when its turn starts: on a shared log, the events appended after
    the instance's head (at most CATCH_UP_PAGE: a full page means read on), and the events
    already recorded under the batch's event_ids."""

    events: list[Event]
    recorded: dict[str, Event]


class HeadMoved(RuntimeError):
    """A shared log's head is no longer where the batch was decided (another statesvc
    appended meanwhile): nothing was written; catch up and decide the batch again."""

    def __init__(self, head: int, expected: int) -> None:
        super().__init__(f"the log's head is at seq {head}, not {expected}")
        self.head = head


# a lost or refused connection (PostgreSQL restarting, a network cut), or a database that
# cannot be read now (SQLite: locked, an I/O error): retryable, never a bug
UNAVAILABLE = (exc.OperationalError, exc.InterfaceError)


class EventStore(Protocol):
    # True where other statesvc instances may append to the same log (PostgreSQL): `append`
    # then raises HeadMoved when the first event's seq is not the head's next
    shared: bool

    def head(self) -> int: ...

    def append(self, events: Sequence[NewEvent], *, blobs: Sequence[NewBlob] = (),
               snapshots: Sequence[Snapshot] = ()) -> list[Event]: ...

    def by_event_ids(self, event_ids: Collection[str]) -> dict[str, Event]: ...

    def read(self, since: int, limit: int, *, until: int | None = None) -> list[Event]: ...

    def latest_snapshot(self, at_or_before: int | None = None) -> Snapshot | None: ...

    def blob_hashes(self) -> set[str]: ...

    def turn(self, since: int, event_ids: Collection[str]) -> AbstractContextManager[Begun]:
        """Held while a batch is caught up, decided and appended; starts by reading the events
        after `since` (a shared log) and those recorded under `event_ids`. On a shared log the
        instances take turns (FIFO) to write, so one that lost an append race cannot lose it
        forever; a batch without writes (no event_ids) takes none."""
        ...

    # the head the store recorded after its last commit before this open (its high-water
    # mark), or None where it keeps none yet
    recorded_head: int | None

    def close(self) -> None: ...


def recovery_steps(data_dir: Path) -> str:
    """What an operator can do about a log that lost events or a damaged database file."""
    return (f"To recover: restore state.db together with its state.db-wal into {data_dir} "
            "(from a backup, or the copy they came from) and start again; or, if those events "
            f"are gone for good, move {data_dir} aside, start statesvc with a new --data-dir, "
            "run `loractl pool init` and `loractl load` again, and restart every replica with "
            "an empty --cache-dir (they refuse a new log while they hold the old one).")


class HighWater:
    """The head after the last commit, in a small file next to the database (state.db.head).

    Written in place with a plain write after every commit, never synced: it survives a
    killed process (which is what a deleted state.db-wal needs to be noticed) at no fsync per
    commit; a power loss is SQLite's to cover (synchronous=FULL), and a mark it leaves behind
    is only lower. The file is created by the first commit."""

    WIDTH = 20

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def read(self) -> int | None:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return None
        if not raw.strip(b"\0"):  # created, then a power loss before its data reached the disk
            return None
        if not re.fullmatch(rb" *[0-9]{1,%d}\n" % self.WIDTH, raw):
            raise StoreError(f"{self.path} does not hold a seq (it holds {raw[:40]!r}); statesvc "
                             "writes the head there after every commit and checks at start that "
                             "the log is not behind it. If state.db is complete, delete "
                             f"{self.path.name} and start again.")
        return int(raw)

    def write(self, seq: int) -> None:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
        os.pwrite(self._fd, b"%*d\n" % (self.WIDTH, seq), 0)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def sqlite_url(data_dir: Path) -> str:
    return f"sqlite:///{Path(data_dir).resolve() / 'state.db'}"


def make_engine(url: str) -> Engine:
    """An engine whose connections use WAL and synchronous=FULL; `write_tx` begins IMMEDIATE."""
    # two connections: the one SqliteEventStore holds for its write path, one for reads
    engine = create_engine(url, pool_size=2, max_overflow=0)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # we issue BEGIN ourselves
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=FULL")
        cur.execute("PRAGMA busy_timeout=5000")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        # writers take the write lock up front; readers need no lock in WAL mode
        immediate = conn.get_execution_options().get("immediate", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

    return engine


def write_tx(engine: Engine) -> Any:
    """A transaction that holds SQLite's write lock from its BEGIN (BEGIN IMMEDIATE)."""
    return engine.execution_options(immediate=True).begin()


# the PostgreSQL advisory lock keys: around migrations, and the writing turn (statesvc/pgstore.py;
# 0x6C6F7261 was the append lock of statesvc before the turn held its batch's transaction)
MIGRATE_LOCK, TURN_LOCK = 0x6C6F7262, 0x6C6F7263


def upgrade_to_head(engine: Engine) -> None:
    """Run the Alembic migrations up to head on this engine's database, in one transaction
    that holds the write lock (SQLite) or the migration lock (PostgreSQL, several instances)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    postgres = engine.dialect.name == "postgresql"
    with (engine.begin() if postgres else write_tx(engine)) as conn:
        if postgres:
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": MIGRATE_LOCK})
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")


def open_store(url: str) -> EventStore:
    """The backend for this SQLAlchemy URL: PostgreSQL for postgresql+psycopg://, else SQLite."""
    if make_url(url).get_backend_name() == "postgresql":
        from statesvc.pgstore import PostgresEventStore
        return PostgresEventStore(url)
    return SqliteEventStore(url)


def _event(row: Any) -> Event:
    """An Event from a row of the events table (an ORM row or a Core Row)."""
    return Event(row.seq, row.event_id, row.type, dict(row.payload), row.recorded_at, row.actor)


_INSERT_EVENT = ("INSERT INTO events (seq, event_id, type, payload, recorded_at, actor) "
                 "VALUES (?, ?, ?, ?, ?, ?)")
_INSERT_BLOB = ("INSERT INTO blobs (sha256, size, first_seq, created_at) VALUES (?, ?, ?, ?) "
                "ON CONFLICT DO NOTHING")
_INSERT_SNAPSHOT = "INSERT INTO snapshots (seq, state, digest, created_at) VALUES (?, ?, ?, ?)"


class SqlReads:
    """The reads both backends run through SQLAlchemy Core."""

    engine: Engine

    def head(self) -> int:
        with self.engine.begin() as conn:
            return int(conn.execute(select(func.coalesce(func.max(EventRow.seq), 0))).scalar_one())

    def read(self, since: int, limit: int, *, until: int | None = None) -> list[Event]:
        """Events with since < seq (<= until), oldest first, at most `limit`."""
        q = select(EventRow).where(EventRow.seq > since)
        if until is not None:
            q = q.where(EventRow.seq <= until)
        with self.engine.begin() as conn:
            return [_event(r) for r in conn.execute(q.order_by(EventRow.seq).limit(limit))]

    def latest_snapshot(self, at_or_before: int | None = None) -> Snapshot | None:
        q = select(SnapshotRow)
        if at_or_before is not None:
            q = q.where(SnapshotRow.seq <= at_or_before)
        with self.engine.begin() as conn:
            row = conn.execute(q.order_by(SnapshotRow.seq.desc()).limit(1)).first()
        return None if row is None else Snapshot(row.seq, bytes(row.state), row.digest)

    def blob_hashes(self) -> set[str]:
        with self.engine.begin() as conn:
            return set(conn.execute(select(BlobRow.sha256)).scalars())


class SqliteEventStore(SqlReads):
    shared = False

    @contextmanager
    def turn(self, since: int, event_ids: Collection[str]) -> Iterator[Begun]:
        # one writer, its own thread: nothing to take turns with or to catch up on
        yield Begun([], self.by_event_ids(event_ids))

    def __init__(self, url: str, *, migrate: bool = True) -> None:
        database = make_url(url).database
        path = Path(database).resolve() if database and database != ":memory:" else None
        self.high_water = None if path is None else HighWater(path.with_name(path.name + ".head"))
        self.recorded_head = None if self.high_water is None else self.high_water.read()
        self.engine = make_engine(url)
        try:
            # before anything is written: a log behind its high-water mark stays as it is
            head = self._stored_head()
            if self.high_water is not None and self.recorded_head is not None \
                    and head < self.recorded_head:
                raise StoreError(
                    f"the log in {path} ends at seq {head}, but it held events up to seq "
                    f"{self.recorded_head} ({self.recorded_head - head} lost; the head after "
                    f"every commit is kept in {self.high_water.path}): most likely "
                    "state.db-wal, SQLite's write-ahead log, was deleted or not copied along "
                    "with state.db. "
                    "statesvc serves no shorter log, since replicas would take other events "
                    "under the same seqs, and changed nothing. A copy that ends before seq "
                    f"{self.recorded_head} is refused as well. "
                    + recovery_steps(self.high_water.path.parent))
            if migrate:
                upgrade_to_head(self.engine)
            # the write path's connection, set up by make_engine's connect hook (WAL,
            # synchronous=FULL, no implicit transactions); held until close
            self._writer = self.engine.raw_connection()
        except exc.DatabaseError as err:
            self.engine.dispose()
            where = path or url
            if isinstance(err.orig, sqlite3.OperationalError):
                raise StoreError(f"cannot open the event store {where}: {err.orig}; check that "
                                 "the path exists and statesvc may read and write it") from None
            data_dir = path.parent if path is not None else Path(".")
            raise StoreError(f"{where} is not a readable SQLite database ({err.orig}): it is "
                             "damaged or not statesvc's. statesvc changed nothing. "
                             + recovery_steps(data_dir)) from None
        except StoreError:
            self.engine.dispose()
            raise
        self._db: sqlite3.Connection = self._writer.driver_connection  # type: ignore[assignment]

    def _stored_head(self) -> int:
        """The head as stored, before migrations: 0 where there is no events table yet."""
        with self.engine.begin() as conn:
            if not inspect(conn).has_table("events"):
                return 0
            return int(conn.execute(text("SELECT coalesce(max(seq), 0) FROM events")).scalar_one())

    def append(self, events: Sequence[NewEvent], *, blobs: Sequence[NewBlob] = (),
               snapshots: Sequence[Snapshot] = ()) -> list[Event]:
        now = utc_now()
        # the payload as SQLAlchemy's JSON type stores it (json.dumps), so reads decode it
        rows = [(e.seq, e.event_id, e.type, json.dumps(e.payload), now, e.actor) for e in events]
        db, sql = self._db, "BEGIN IMMEDIATE"
        try:
            db.execute(sql)
            try:
                if rows:
                    sql = _INSERT_EVENT
                    db.executemany(sql, rows)
                if blobs:
                    sql = _INSERT_BLOB
                    db.executemany(sql, [(b.sha256, b.size, b.first_seq, now) for b in blobs])
                if snapshots:
                    sql = _INSERT_SNAPSHOT
                    db.executemany(sql, [(s.seq, s.state, s.digest, now) for s in snapshots])
                sql = "COMMIT"
                db.execute(sql)
            except BaseException:
                if db.in_transaction:
                    db.rollback()
                raise
        except sqlite3.Error as err:
            raise exc.DBAPIError.instance(sql, None, err, sqlite3.Error) from err
        if self.high_water is not None and events:
            self.high_water.write(events[-1].seq)
        return [Event(e.seq, e.event_id, e.type, e.payload, now, e.actor) for e in events]

    def by_event_ids(self, event_ids: Collection[str]) -> dict[str, Event]:
        if not event_ids:
            return {}
        ids = tuple(event_ids)
        sql = ("SELECT seq, event_id, type, payload, recorded_at, actor FROM events "
               f"WHERE event_id IN ({','.join('?' * len(ids))})")
        try:
            rows = self._db.execute(sql, ids).fetchall()
        except sqlite3.Error as err:
            raise exc.DBAPIError.instance(sql, None, err, sqlite3.Error) from err
        return {str(r[1]): Event(int(r[0]), str(r[1]), str(r[2]), json.loads(r[3]), str(r[4]),
                                 str(r[5])) for r in rows}

    def close(self) -> None:
        self._writer.close()
        self.engine.dispose()
        if self.high_water is not None:
            self.high_water.close()
