"""What both backends of the log share: the EventStore and BlobStore protocols, the values
that cross them (NewEvent, NewBlob, Snapshot, Begun), their errors, and the reads both run
through SQLAlchemy Core. A backend module (sqlite.py, postgres.py) imports this one and no
other backend; `open_log` (statesvc/persistence/__init__.py) picks the backend.
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Collection, Protocol, Sequence

from alembic import command
from alembic.config import Config
from sqlalchemy import Connection, Engine, exc, func, select

from shared.config import MAX_BLOB_CHUNK
from shared.events import Event
from statesvc.models import BlobRow, EventRow, SnapshotRow

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent.parent / "migrations"


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

class BlobStore(Protocol):
    """Adapter weights by the sha256 of their bytes, immutable once stored: what the service
    checks a load against and what the fleet fetches by hash (shared/blobserve.py)."""

    # True where blobs live in the log (PostgreSQL): a new blob's bytes are written by the
    # event store in its event's transaction (NewBlob.data), never `put` but to repair one,
    # so no blob exists without its event and there is nothing to sweep; the fleet fetches
    # them from the log, and `committed` keeps them for the fetches right after their load.
    # False (files, SQLite): a new blob is `put` durably before the event that names it.
    in_log: bool

    def has(self, sha256: str) -> bool: ...

    def put(self, data: bytes | bytearray, sha256: str | None = None, *,
            overwrite: bool = False,
            progress: Callable[[], None] = lambda: None) -> tuple[str, bool]:
        """Store `data`; returns (sha256, created). `overwrite` rewrites a stored blob (to
        repair a damaged copy)."""
        ...

    def committed(self, sha256: str, data: bytes | bytearray) -> None:
        """A blob this instance has just committed with its event (NewBlob.data)."""
        ...

    def size(self, sha256: str) -> int: ...

    def read_chunk(self, sha256: str, offset: int, length: int = MAX_BLOB_CHUNK) -> bytes:
        """At most `length` (and MAX_BLOB_CHUNK) bytes from `offset`; b"" past the end."""
        ...

    def verify(self, sha256: str) -> bool:
        """True when the blob exists and its stored bytes hash to its name."""
        ...

    def remove(self, sha256: str) -> None:
        """Forget a blob whose event was not committed."""
        ...

    def all(self) -> set[str]: ...

    def sweep(self, keep: set[str], *, log_complete: bool = True) -> list[str]:
        """Delete the blobs not in `keep` (no event refers to them: left by a crash between
        blob and event) and return them; `log_complete` False (the log cannot show that it
        lost no events) deletes none."""
        ...


def upgrade_to_head(conn: Connection) -> None:
    """Run the Alembic migrations up to head on this connection, in its transaction (which
    the backend begins holding its write lock: migrations run once, whoever starts first)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.attributes["connection"] = conn
    command.upgrade(cfg, "head")


def _event(row: Any) -> Event:
    """An Event from a row of the events table (an ORM row or a Core Row)."""
    return Event(row.seq, row.event_id, row.type, dict(row.payload), row.recorded_at, row.actor)


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
