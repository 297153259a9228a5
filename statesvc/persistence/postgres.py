"""The event store on PostgreSQL (psycopg 3): several statesvc instances on one log.

Seqs stay gapless and commit in seq order with several writers: a batch with writes runs in
one transaction that first takes a transaction-scoped advisory lock, the writing turn
(`pg_advisory_xact_lock(TURN_LOCK)`; waiters are granted it in order), then reads the head
after the lock was granted, decides, appends after that head and commits, which releases the
lock. So no append commits while another holds seqs below its own, and a reader following by
seq never skips one that commits later (the bug Marten shipped with a high-water mark over a
sequence). An advisory lock rather than `LOCK TABLE events IN EXCLUSIVE MODE`
(pyeventsourcing's way): it serialises only the writers, never touches the table's lock queue
(autovacuum, `pg_dump`, readers), and is released by the transaction's end however it ends, a
killed statesvc included. An append whose first seq is not the head's next raises HeadMoved
and writes nothing: the service catches up and decides its batch again, so `--expect-head`
and idempotency by event_id hold across instances.

Every append also NOTIFYs CHANNEL (delivered at its commit): `Doorbell` lets each instance
hear that the log grew and read the new events by seq, so it publishes every event, its own
and the others', in seq order. NOTIFY is not durable; the instance reads by seq after every
reconnect and once a second anyway.

Blobs live in the database (statesvc/persistence/postgres_blobs.py), written in the
events' transaction.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Any, Collection, Iterator, Sequence

import psycopg
from psycopg.conninfo import make_conninfo
from psycopg.pq import TransactionStatus
from psycopg.types.json import Json
from sqlalchemy import Engine, create_engine, exc, make_url, text

from shared.events import Event
from statesvc.persistence.base import (CATCH_UP_PAGE, Begun, HeadMoved, NewBlob, NewEvent,
                                       Snapshot, SqlReads, StoreError, upgrade_to_head, utc_now)
from statesvc.persistence.postgres_blobs import chunk_rows

# the advisory lock keys: around migrations, and the writing turn (0x6C6F7261 was the append
# lock of statesvc before the turn held its batch's transaction)
MIGRATE_LOCK, TURN_LOCK = 0x6C6F7262, 0x6C6F7263
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
# Executed unprepared, planned for its own array each time. psycopg prepares a statement on
# its 5th execution, and PostgreSQL then settles on a generic plan for it: for this query,
# chosen while the log was small, a sequential scan of `events`, kept as the log grew. Every
# batch then read the whole log: bench_pg's 4 clients on one instance lost a fifth of their
# rate with each 3,200 events (1,163 events/s at first, 335 after 22,400; PostgreSQL's CPU
# an event 0.26 -> 2.1 ms), while the same query planned for its array uses the event_id
# index whatever the log's length (about 0.1 ms more of planning a batch).
_UNPREPARED = False
_TURN = "SELECT pg_advisory_xact_lock(%s)"
_INTRANS, _IDLE = TransactionStatus.INTRANS, TransactionStatus.IDLE
# a batch's events in one statement, with the NOTIFY: the same rows as one INSERT per event,
# without psycopg sending and processing a statement per event (16 at 16 clients)
_INSERT_EVENTS = (f"WITH rows AS (INSERT INTO events ({_COLUMNS}) SELECT * FROM unnest("
                  "%s::bigint[], %s::varchar[], %s::varchar[], %s::json[], %s::varchar[], "
                  "%s::varchar[])) SELECT pg_notify(%s, %s)")
_INSERT_BLOB = ("INSERT INTO blobs (sha256, size, first_seq, created_at) VALUES (%s, %s, %s, %s) "
                "ON CONFLICT DO NOTHING")
_INSERT_CHUNK = ("INSERT INTO blob_chunks (sha256, idx, data) VALUES (%s, %s, %s) "
                 "ON CONFLICT DO NOTHING")
_INSERT_SNAPSHOT = "INSERT INTO snapshots (seq, state, digest, created_at) VALUES (%s, %s, %s, %s)"


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
        self._generation = 0  # connections made: a turn taken on one is held by its transaction
        self._open: tuple[int, int] | None = None  # the turn held: (generation, head at its start)
        self._lock = threading.Lock()  # the held connection: one statement at a time
        try:
            if migrate:
                with self.engine.begin() as conn:  # the migration lock: several instances
                    conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": MIGRATE_LOCK})
                    upgrade_to_head(conn)
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
    # plain SQL on one psycopg connection the store holds (autocommit outside a turn), like
    # SqliteEventStore's: through the pool, each statement cost a pre-ping round trip and
    # SQLAlchemy's per-statement work. A batch with writes costs two round trips (psycopg
    # pipelines): its turn's start (BEGIN, the lock, the head, the events after the
    # instance's head, the batch's event_ids), and its append (the rows, the NOTIFY, COMMIT).
    # Errors are raised as SQLAlchemy's, like the rest of the store's.

    def _connection(self) -> psycopg.Connection[Any]:
        db = self._db
        if db is None or db.closed or db.broken:
            if db is not None:
                db.close()
            self._db = db = psycopg.connect(make_conninfo(self._dsn, **TCP_OPTIONS),
                                            autocommit=True, connect_timeout=CONNECT_TIMEOUT_S)
            self._generation += 1
        return db

    def _query(self, sql: str, params: Sequence[Any] = (), *,
               prepare: bool | None = None) -> list[tuple[Any, ...]]:
        """One read on the held connection; a connection found lost (PostgreSQL restarted
        since its last use) is replaced and the read tried once more, as the pool's pre-ping
        did. `prepare`: psycopg's (None: prepared once executed often enough)."""
        with self._lock:
            for attempt in (1, 2):
                try:
                    return self._connection().execute(sql, params, prepare=prepare).fetchall()
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
        return [_event(r) for r in self._query(_READ, (since, until, until, limit))]

    def by_event_ids(self, event_ids: Collection[str]) -> dict[str, Event]:
        if not event_ids:
            return {}
        return {r[1]: _event(r) for r in self._query(_BY_EVENT_IDS, (list(event_ids),),
                                                      prepare=_UNPREPARED)}

    def append(self, events: Sequence[NewEvent], *, blobs: Sequence[NewBlob] = (),
               snapshots: Sequence[Snapshot] = ()) -> list[Event]:
        """In the turn's transaction (one round trip: the rows, the NOTIFY and COMMIT), or,
        outside a turn (a second commit in a batch, a tool), in a transaction of its own that
        takes the turn first (two). Never retried: a connection lost in COMMIT leaves the
        outcome unknown (the service says so)."""
        now = utc_now()
        with self._lock:
            try:
                db = self._connection()
                head = self._turn_head(db)
                if head is None:
                    head = self._begin(db, None, ())[0]
                if events and head != events[0].seq - 1:
                    self._end(db)  # writes nothing, and lets the others write meanwhile
                    raise HeadMoved(head, events[0].seq - 1)
                with db.pipeline():
                    if events:
                        db.execute(_INSERT_EVENTS, (
                            [e.seq for e in events], [e.event_id for e in events],
                            [e.type for e in events], [Json(e.payload) for e in events],
                            [now] * len(events), [e.actor for e in events],
                            CHANNEL, str(events[-1].seq)))
                    if blobs:
                        db.cursor().executemany(_INSERT_BLOB, [(b.sha256, b.size, b.first_seq, now)
                                                               for b in blobs])
                        chunks = [(r["sha256"], r["idx"], r["data"]) for b in blobs
                                  if b.data is not None for r in chunk_rows(b.sha256, b.data)]
                        if chunks:
                            db.cursor().executemany(_INSERT_CHUNK, chunks)
                    if snapshots:
                        db.cursor().executemany(_INSERT_SNAPSHOT, [(s.seq, s.state, s.digest, now)
                                                                   for s in snapshots])
                    db.execute("COMMIT")
                self._open = None
            except psycopg.Error as err:
                if self._db is not None:
                    self._end(self._db)
                raise exc.DBAPIError.instance(_INSERT_EVENTS, None, err, psycopg.Error) from err
        return [Event(e.seq, e.event_id, e.type, e.payload, now, e.actor) for e in events]

    @contextmanager
    def turn(self, since: int, event_ids: Collection[str]) -> Iterator[Begun]:
        """The instances' turn to write, held by the batch's transaction until its append
        commits (or the turn ends without one: ROLLBACK). Without turns, one that lost an
        append race catches up while the winner decides its next batch on a head already
        current, and can lose again and again. A batch without writes only catches up."""
        if not event_ids:
            yield Begun(self.read(since, CATCH_UP_PAGE), {})
            return
        with self._lock:
            for attempt in (1, 2):
                try:
                    head, events, recorded = self._begin(self._connection(), since, event_ids)
                    break
                except psycopg.Error as err:
                    if self._db is not None:
                        self._end(self._db)  # a connection lost is closed by it
                    # one found lost (PostgreSQL restarted since its last use): nothing was
                    # read or written on it, so once more on a new one
                    if attempt == 2 or not (self._db is None or self._db.closed):
                        raise exc.DBAPIError.instance(_TURN, None, err, psycopg.Error) from err
            self._open = (self._generation, head)
        try:
            yield Begun(events, recorded)
        finally:
            with self._lock:
                if self._open is not None and self._db is not None:
                    self._end(self._db)

    def _begin(self, db: psycopg.Connection[Any], since: int | None, event_ids: Collection[str],
               ) -> tuple[int, list[Event], dict[str, Event]]:
        """One round trip: BEGIN, the turn's lock, then what is read after it was granted (read
        committed: each statement sees what committed before it started): the head, the
        events after `since` and those recorded under `event_ids`."""
        with db.pipeline():
            db.execute("BEGIN")
            db.execute(_TURN, (TURN_LOCK,))
            head = db.execute(_HEAD)
            after = None if since is None else db.execute(_READ, (since, None, None,
                                                                  CATCH_UP_PAGE))
            known = db.execute(_BY_EVENT_IDS, (list(event_ids),),
                               prepare=_UNPREPARED) if event_ids else None
        row = head.fetchone()
        return (int(row[0]) if row else 0,
                [] if after is None else [_event(r) for r in after.fetchall()],
                {} if known is None else {r[1]: _event(r) for r in known.fetchall()})

    def _turn_head(self, db: psycopg.Connection[Any]) -> int | None:
        """The head read at the start of the turn this connection holds; None where it holds
        none (not begun, committed, or lost with a connection replaced since)."""
        if self._open is None:
            return None
        generation, head = self._open
        if generation == self._generation and db.info.transaction_status == _INTRANS:
            return head
        self._end(db)
        return None

    def _end(self, db: psycopg.Connection[Any]) -> None:
        """End the transaction open on `db`, if any, writing nothing: ROLLBACK releases the
        turn; where it cannot be sent, closing the connection ends its session, and the turn."""
        self._open = None
        if db.closed or db.info.transaction_status == _IDLE:
            return
        try:
            db.execute("ROLLBACK")
        except psycopg.Error:
            db.close()

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


def _event(row: tuple[Any, ...]) -> Event:
    return Event(int(row[0]), row[1], row[2], row[3], row[4], row[5])


def _seq_of(payload: str) -> int:
    """The seq a notice names; one that names none (not ours) counts as new."""
    return int(payload) if payload.isdigit() else 1 << 62

