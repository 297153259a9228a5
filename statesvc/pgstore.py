"""The event store on PostgreSQL (psycopg 3): several statesvc instances on one log.

Seqs stay gapless and commit in seq order with several writers: every append takes one
transaction-scoped advisory lock (`pg_advisory_xact_lock(APPEND_LOCK)`), then checks that the
head is the seq before its first event, inserts, and commits, which releases the lock. So no
append commits while another holds seqs below its own, and a reader following by seq never
skips one that commits later (the bug Marten shipped with a high-water mark over a sequence).
An advisory lock rather than `LOCK TABLE events IN EXCLUSIVE MODE` (pyeventsourcing's way):
it serialises only appends, never touches the table's lock queue (autovacuum, `pg_dump`,
readers), and is released by the transaction's end however it ends, a killed statesvc
included. An append whose head moved raises HeadMoved and writes nothing: the service catches
up and decides its batch again, so `--expect-head` and idempotency by event_id hold across
instances.

Every append also NOTIFYs CHANNEL (delivered at its commit): `Doorbell` lets each instance
hear that the log grew and read the new events by seq, so it publishes every event, its own
and the others', in seq order. NOTIFY is not durable; the instance reads by seq after every
reconnect and once a second anyway.

Blobs live in the database (statesvc/pgblobs.py), written in the events' transaction.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Any, Collection, Iterator, Sequence

import psycopg
from psycopg.conninfo import make_conninfo
from psycopg.types.json import Json
from sqlalchemy import Engine, create_engine, exc, make_url

from shared.events import Event
from statesvc.store import (APPEND_LOCK, TURN_LOCK, HeadMoved, NewBlob, NewEvent, Snapshot, SqlReads,
                            StoreError, upgrade_to_head, utc_now)

CHUNK_BYTES = 1 << 20  # a blob's bytes, one row per MiB
CHANNEL = "loraplane_events"  # NOTIFY'd by every append, with its last seq
CONNECT_TIMEOUT_S = 5
# a connection whose peer went silent (a cut link, a host gone: no RST) fails within about
# 10 s instead of waiting forever: data unacknowledged for TCP_USER_TIMEOUT, or an idle
# connection's keepalive probes unanswered. Then the command is answered storage_error, and
# the pool's pre-ping (itself bounded so) replaces the connection.
TCP_OPTIONS = {"keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2,
               "keepalives_count": 3, "tcp_user_timeout": 10_000}
RECONNECT_S = 5.0  # the doorbell tries to reconnect this often while PostgreSQL is away

_HEAD = "SELECT coalesce(max(seq), 0) FROM events"
_COLUMNS = "seq, event_id, type, payload, recorded_at, actor"
_READ = (f"SELECT {_COLUMNS} FROM events WHERE seq > %s AND (%s::bigint IS NULL OR seq <= %s) "
         "ORDER BY seq LIMIT %s")
_BY_EVENT_IDS = f"SELECT {_COLUMNS} FROM events WHERE event_id = ANY(%s)"
_LOCK = "SELECT pg_advisory_xact_lock(%s)"
_TURN, _UNTURN = "SELECT pg_advisory_lock(%s)", "SELECT pg_advisory_unlock(%s)"
_NOTIFY = "SELECT pg_notify(%s, %s)"
_INSERT_EVENT = f"INSERT INTO events ({_COLUMNS}) VALUES (%s, %s, %s, %s, %s, %s)"
_INSERT_BLOB = ("INSERT INTO blobs (sha256, size, first_seq, created_at) VALUES (%s, %s, %s, %s) "
                "ON CONFLICT DO NOTHING")
_INSERT_CHUNK = ("INSERT INTO blob_chunks (sha256, idx, data) VALUES (%s, %s, %s) "
                 "ON CONFLICT DO NOTHING")
_INSERT_SNAPSHOT = "INSERT INTO snapshots (seq, state, digest, created_at) VALUES (%s, %s, %s, %s)"


def chunk_rows(sha256: str, data: bytes | bytearray) -> list[dict[str, Any]]:
    view = memoryview(data)
    return [{"sha256": sha256, "idx": i // CHUNK_BYTES, "data": bytes(view[i:i + CHUNK_BYTES])}
            for i in range(0, len(view), CHUNK_BYTES)]


def pg_engine(url: str) -> Engine:
    # a database that stops answering costs a command seconds, never the service's loop forever
    return create_engine(url, pool_size=4, max_overflow=4, pool_pre_ping=True,
                         connect_args={"connect_timeout": CONNECT_TIMEOUT_S, **TCP_OPTIONS})


class PostgresEventStore(SqlReads):
    shared = True

    def __init__(self, url: str, *, migrate: bool = True) -> None:
        self.where = make_url(url).render_as_string(hide_password=True)
        self.engine = pg_engine(url)
        self._dsn = self.engine.url.set(drivername="postgresql").render_as_string(
            hide_password=False)
        self._db: psycopg.Connection[Any] | None = None
        self._generation = 0  # connections made: a turn taken on one is released on it
        self._lock = threading.Lock()  # the held connection: one statement at a time
        try:
            if migrate:
                upgrade_to_head(self.engine)
            # PostgreSQL keeps what it acknowledged (fsync, synchronous_commit): its head is
            # the head recorded, and there is no high-water file to compare with
            self.recorded_head: int | None = self.head()
        except exc.OperationalError as err:
            self.close()
            raise StoreError(f"cannot open the event store {self.where}: {err.orig}; check "
                             "that PostgreSQL runs there and that the URL's user, password, "
                             "host, port and database are right (the database must exist: "
                             "`createdb NAME`)") from None
        except exc.DatabaseError as err:
            self.close()
            raise StoreError(f"{self.where} cannot hold statesvc's log ({err.orig}); "
                             "statesvc changed nothing; give it a database of its own") from None

    # ---- the command thread's connection --------------------------------------
    # The write path (the turn, the catch-up read, the event_id lookup, the append) runs
    # plain SQL on one psycopg connection the store holds (autocommit; the append is one
    # explicit transaction in two round trips), like SqliteEventStore's: through the pool,
    # each of them cost a pre-ping round trip and SQLAlchemy's per-statement work, about
    # 15 round trips a batch. Errors are raised as SQLAlchemy's, like the rest of the store's.

    def _connection(self) -> psycopg.Connection[Any]:
        db = self._db
        if db is None or db.closed or db.broken:
            if db is not None:
                db.close()
            self._db = db = psycopg.connect(make_conninfo(self._dsn, **TCP_OPTIONS),
                                            autocommit=True, connect_timeout=CONNECT_TIMEOUT_S)
            self._generation += 1
        return db

    def _query(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """One read on the held connection; a connection found lost (PostgreSQL restarted
        since its last use) is replaced and the read tried once more, as the pool's pre-ping
        did."""
        with self._lock:
            for attempt in (1, 2):
                try:
                    return self._connection().execute(sql, params).fetchall()
                except psycopg.OperationalError as err:
                    if attempt == 2 or not (self._db is None or self._db.broken
                                            or self._db.closed):
                        raise exc.DBAPIError.instance(sql, params, err, psycopg.Error) from err
                except psycopg.Error as err:
                    raise exc.DBAPIError.instance(sql, params, err, psycopg.Error) from err
        raise AssertionError("unreachable")

    def head(self) -> int:
        return int(self._query(_HEAD)[0][0])

    def read(self, since: int, limit: int, *, until: int | None = None) -> list[Event]:
        """Events with since < seq (<= until), oldest first, at most `limit`."""
        rows = self._query(_READ, (since, until, until, limit))
        return [Event(int(r[0]), r[1], r[2], r[3], r[4], r[5]) for r in rows]

    def by_event_ids(self, event_ids: Collection[str]) -> dict[str, Event]:
        if not event_ids:
            return {}
        rows = self._query(_BY_EVENT_IDS, (list(event_ids),))
        return {r[1]: Event(int(r[0]), r[1], r[2], r[3], r[4], r[5]) for r in rows}

    def append(self, events: Sequence[NewEvent], *, blobs: Sequence[NewBlob] = (),
               snapshots: Sequence[Snapshot] = ()) -> list[Event]:
        """One transaction, two round trips: BEGIN, the append lock and the head (read
        committed: the head's snapshot is taken after the lock was granted), then the rows,
        the NOTIFY and COMMIT. Never retried: a connection lost in COMMIT leaves the outcome
        unknown (the service says so)."""
        now = utc_now()
        sql = "BEGIN"
        with self._lock:
            db = self._connection()
            try:
                with db.pipeline() as pipe, db.transaction():
                    sql = _LOCK
                    db.execute(sql, (APPEND_LOCK,))
                    if events:
                        sql = _HEAD
                        cur = db.execute(sql)
                        pipe.sync()
                        row = cur.fetchone()
                        head = int(row[0]) if row else 0
                        if head != events[0].seq - 1:
                            raise HeadMoved(head, events[0].seq - 1)
                        sql = _INSERT_EVENT
                        db.cursor().executemany(sql, [
                            (e.seq, e.event_id, e.type, Json(e.payload), now, e.actor)
                            for e in events])
                        sql = _NOTIFY
                        db.execute(sql, (CHANNEL, str(events[-1].seq)))
                    if blobs:
                        sql = _INSERT_BLOB
                        db.cursor().executemany(sql, [(b.sha256, b.size, b.first_seq, now)
                                                      for b in blobs])
                        chunks = [(r["sha256"], r["idx"], r["data"]) for b in blobs
                                  if b.data is not None for r in chunk_rows(b.sha256, b.data)]
                        if chunks:
                            sql = _INSERT_CHUNK
                            db.cursor().executemany(sql, chunks)
                    if snapshots:
                        sql = _INSERT_SNAPSHOT
                        db.cursor().executemany(sql, [(s.seq, s.state, s.digest, now)
                                                      for s in snapshots])
                    sql = "COMMIT"
            except psycopg.Error as err:
                raise exc.DBAPIError.instance(sql, None, err, psycopg.Error) from err
        return [Event(e.seq, e.event_id, e.type, e.payload, now, e.actor) for e in events]

    @contextmanager
    def turn(self) -> Iterator[None]:
        """The instances' turn to write, a session advisory lock (waiters are granted it in
        order): without it, one that lost an append race catches up while the winner decides
        its next batch on a head already current, and can lose again and again."""
        self._query(_TURN, (TURN_LOCK,))
        generation = self._generation
        try:
            yield
        finally:
            # a connection replaced meanwhile took the lock with its session
            if generation == self._generation:
                try:
                    self._query(_UNTURN, (TURN_LOCK,))
                except exc.DBAPIError:
                    with self._lock:
                        if self._db is not None:
                            self._db.close()  # its session is gone, and the lock with it

    def doorbell(self) -> Doorbell:
        return Doorbell(self._dsn)

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None
        self.engine.dispose()


class Doorbell:
    """A connection that LISTENs on CHANNEL: `fileno()` to poll on, `rang()` to drain it."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.conn: psycopg.Connection[Any] | None = None
        self._retry_at = 0.0

    def fileno(self) -> int | None:
        """The socket to poll for notices; None while PostgreSQL cannot be reached (tried
        again every RECONNECT_S)."""
        if (self.conn is None or self.conn.closed) and time.monotonic() >= self._retry_at:
            self._retry_at = time.monotonic() + RECONNECT_S
            try:
                self.conn = psycopg.connect(make_conninfo(self.dsn, **TCP_OPTIONS),
                                            autocommit=True, connect_timeout=2)
                self.conn.execute(f"LISTEN {CHANNEL}")
            except psycopg.Error:
                self.conn = None
        return None if self.conn is None or self.conn.closed else self.conn.fileno()

    def rang(self, after: int) -> bool:
        """True when a notice names a seq beyond `after` (the instance's head: the notices of
        its own commits, and of others' it already read, need no read), or the connection was
        lost (notices may have been missed: read the log either way)."""
        if self.conn is None:
            return True
        try:
            return any(_seq_of(n.payload) > after for n in list(self.conn.notifies(timeout=0)))
        except psycopg.Error:
            self.close()
            return True

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def _seq_of(payload: str) -> int:
    """The seq a notice names; one that names none (not ours) counts as new."""
    return int(payload) if payload.isdigit() else 1 << 62
