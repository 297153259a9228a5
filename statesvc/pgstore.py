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

import time
from contextlib import contextmanager
from typing import Any, Collection, Iterator, Sequence

import psycopg
from psycopg.conninfo import make_conninfo
from sqlalchemy import Engine, create_engine, exc, insert, make_url, select, text
from sqlalchemy.dialects.postgresql import insert as pg_insert

from shared.events import Event
from statesvc.models import BlobChunkRow, BlobRow, EventRow, SnapshotRow
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
        try:
            if migrate:
                upgrade_to_head(self.engine)
            # PostgreSQL keeps what it acknowledged (fsync, synchronous_commit): its head is
            # the head recorded, and there is no high-water file to compare with
            self.recorded_head: int | None = self.head()
        except exc.OperationalError as err:
            self.engine.dispose()
            raise StoreError(f"cannot open the event store {self.where}: {err.orig}; check "
                             "that PostgreSQL runs there and that the URL's user, password, "
                             "host, port and database are right (the database must exist: "
                             "`createdb NAME`)") from None
        except exc.DatabaseError as err:
            self.engine.dispose()
            raise StoreError(f"{self.where} cannot hold statesvc's log ({err.orig}); "
                             "statesvc changed nothing; give it a database of its own") from None

    def append(self, events: Sequence[NewEvent], *, blobs: Sequence[NewBlob] = (),
               snapshots: Sequence[Snapshot] = ()) -> list[Event]:
        now = utc_now()
        with self.engine.begin() as conn:
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": APPEND_LOCK})
            if events:
                # read committed: this statement's snapshot is taken after the lock was granted
                head = int(conn.execute(text("SELECT coalesce(max(seq), 0) FROM events"))
                           .scalar_one())
                if head != events[0].seq - 1:
                    raise HeadMoved(head, events[0].seq - 1)
                conn.execute(insert(EventRow), [
                    {"seq": e.seq, "event_id": e.event_id, "type": e.type, "payload": e.payload,
                     "recorded_at": now, "actor": e.actor} for e in events])
                conn.execute(text("SELECT pg_notify(:c, :s)"),
                             {"c": CHANNEL, "s": str(events[-1].seq)})
            if blobs:
                conn.execute(pg_insert(BlobRow).on_conflict_do_nothing(), [
                    {"sha256": b.sha256, "size": b.size, "first_seq": b.first_seq,
                     "created_at": now} for b in blobs])
                chunks = [row for b in blobs if b.data is not None
                          for row in chunk_rows(b.sha256, b.data)]
                if chunks:
                    conn.execute(pg_insert(BlobChunkRow).on_conflict_do_nothing(), chunks)
            if snapshots:
                conn.execute(insert(SnapshotRow), [
                    {"seq": s.seq, "state": s.state, "digest": s.digest, "created_at": now}
                    for s in snapshots])
        return [Event(e.seq, e.event_id, e.type, e.payload, now, e.actor) for e in events]

    @contextmanager
    def turn(self) -> Iterator[None]:
        """The instances' turn to write, a session advisory lock (waiters are granted it in
        order): without it, one that lost an append race catches up while the winner decides
        its next batch on a head already current, and can lose again and again."""
        with self.engine.connect() as conn:
            conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": TURN_LOCK})
            conn.commit()
            try:
                yield
            finally:
                try:
                    conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": TURN_LOCK})
                    conn.commit()
                except exc.DBAPIError:
                    conn.invalidate()  # its session is gone, and the lock with it

    def by_event_ids(self, event_ids: Collection[str]) -> dict[str, Event]:
        if not event_ids:
            return {}
        q = select(EventRow).where(EventRow.event_id.in_(list(event_ids)))
        with self.engine.begin() as conn:
            return {r.event_id: Event(r.seq, r.event_id, r.type, dict(r.payload),
                                      r.recorded_at, r.actor) for r in conn.execute(q)}

    def doorbell(self) -> Doorbell:
        return Doorbell(self.engine.url.set(drivername="postgresql")
                        .render_as_string(hide_password=False))

    def close(self) -> None:
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

    def rang(self) -> bool:
        """True when a notice came, or the connection was lost (notices may have been missed:
        read the log either way)."""
        if self.conn is None:
            return True
        try:
            return sum(1 for _ in self.conn.notifies(timeout=0)) > 0
        except psycopg.Error:
            self.close()
            return True

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None
