"""Where statesvc keeps its log: `open_log(url)` picks the backend.

One backend per module, each importing base.py (the protocols and the values that cross
them) and no other backend: sqlite.py (one statesvc: the log in a SQLite file, blobs as
files beside it) and postgres.py, with its blob store in postgres_blobs.py (several statesvc
on one database, blobs in it; two modules only to keep each under 450 lines).
"""
from __future__ import annotations

from pathlib import Path

from sqlalchemy import make_url

from statesvc.persistence.base import BlobStore, EventStore, StoreError
from statesvc.persistence.sqlite import (FileBlobStore, SqliteEventStore, recovery_steps,
                                         sqlite_url)


def _postgres(url: str) -> bool:
    return make_url(url).get_backend_name() == "postgresql"


def open_store(url: str) -> EventStore:
    """The event store alone (`statesvc migrate`): PostgreSQL for postgresql+psycopg://,
    else SQLite."""
    if _postgres(url):
        from statesvc.persistence.postgres import PostgresEventStore
        return PostgresEventStore(url)
    return SqliteEventStore(url)


def open_log(url: str, *, blobs_dir: Path | None = None) -> tuple[EventStore, BlobStore]:
    """The seam between the service and storage: the event store for this SQLAlchemy URL and
    the blob store that goes with it, migrated to head.

    What crosses it: NewEvent, NewBlob and Snapshot in (one `append` a batch, in one
    durable transaction), Event, Snapshot, Begun and blob bytes out, and the errors
    StoreError (at open), HeadMoved (a shared log moved) and SQLAlchemy's (UNAVAILABLE:
    retryable). No SQL, engine, connection, path or backend class crosses it: the service
    knows a backend only by `EventStore.shared` and `BlobStore.in_log`.

    PostgreSQL (postgresql+psycopg://): blobs in the same database. Else SQLite: blobs as
    files in `blobs_dir` (default: `blobs` beside the database file). StoreError where the
    log cannot be served as it is (nothing was changed)."""
    if _postgres(url):
        from statesvc.persistence.postgres import PostgresEventStore
        from statesvc.persistence.postgres_blobs import LogBlobStore
        pg = PostgresEventStore(url)
        return pg, LogBlobStore(pg.engine)
    database = make_url(url).database
    if blobs_dir is None and (not database or database == ":memory:"):
        raise ValueError(f"{url} is not a file: give open_log a blobs_dir")
    store = SqliteEventStore(url)
    try:
        return store, FileBlobStore(blobs_dir or Path(str(database)).resolve().parent / "blobs")
    except BaseException:
        store.close()
        raise


__all__ = ["BlobStore", "EventStore", "StoreError", "open_log", "open_store", "recovery_steps",
           "sqlite_url"]
