"""Blobs in the database (PostgreSQL): any statesvc instance on the log serves any blob.

The bytes are written by the event store (statesvc/persistence/postgres.py) in the
transaction of the event that first names them (`NewBlob.data`), in CHUNK_BYTES rows of
`blob_chunks`: no blob exists without its event, so there is nothing to sweep, and no
instance can delete what another is about to commit.

Every replica of a fleet fetches each new blob right after its load, so the same chunks are
read N times within a second: the store keeps the sizes of the blobs it has seen and the
most recently read or committed chunk rows (up to CACHE_BYTES) in memory, and a fetch of a
blob this instance has just committed, or one another replica fetched moments before, costs
no database round trip. Blobs are content-addressed and immutable (a repair rewrites
the same bytes and drops the cached rows); `verify` always reads the database.
"""
from __future__ import annotations

import hashlib
import threading
import time
from typing import Any, Callable

import psycopg
from sqlalchemy import Engine, delete, exc, insert, select

from shared.config import MAX_BLOB_CHUNK
from shared.lru import ByteLRU
from statesvc.models import BlobChunkRow, BlobRow

CHUNK_BYTES = 1 << 20  # a blob's bytes, one row per MiB
CACHE_BYTES = 64 << 20  # chunk rows kept in memory per instance, most recently read
CACHE_TTL_S = 30.0  # a cached row is read again after this (a repair elsewhere shows)


def chunk_rows(sha256: str, data: bytes | bytearray) -> list[dict[str, Any]]:
    view = memoryview(data)
    return [{"sha256": sha256, "idx": i // CHUNK_BYTES, "data": bytes(view[i:i + CHUNK_BYTES])}
            for i in range(0, len(view), CHUNK_BYTES)]


class LogBlobStore:
    """The BlobStore (statesvc/persistence/base.py) over the `blobs` and `blob_chunks`
    tables."""

    in_log = True  # BlobStore: written with their event, fetched from the log

    def __init__(self, engine: Engine, *, cache_bytes: int = CACHE_BYTES) -> None:
        self.engine = engine
        # the command thread (load) and the blob thread (blobserve.py) share the caches
        self._lock = threading.Lock()
        self._sizes: dict[str, int] = {}  # 64 bytes of key a blob: never evicted
        # chunk rows, each with the monotonic time it expires at
        self._rows: ByteLRU[tuple[str, int], tuple[bytes, float]] = ByteLRU(
            cache_bytes, lambda row: len(row[0]))

    def has(self, sha256: str) -> bool:
        return self._size(sha256) is not None

    def _size(self, sha256: str) -> int | None:
        with self._lock:
            if sha256 in self._sizes:
                return self._sizes[sha256]
        with self.engine.begin() as conn:
            size = conn.execute(select(BlobRow.size).where(BlobRow.sha256 == sha256)
                                ).scalar_one_or_none()
        if size is not None:
            with self._lock:
                self._sizes[sha256] = int(size)
        return None if size is None else int(size)

    def _chunk_rows(self, sha256: str, first: int, last: int) -> list[bytes]:
        """Rows first..last of a blob: from the cache, the rest in one query."""
        now = time.monotonic()
        with self._lock:
            got: dict[int, bytes | None] = {}
            for i in range(first, last + 1):
                hit = self._rows.get((sha256, i))
                got[i] = hit.value[0] if hit is not None and hit.value[1] > now else None
        missing = [i for i, row in got.items() if row is None]
        if missing:
            read = self._read_rows(sha256, missing)
            got.update(read)
            self._keep(sha256, read, now + CACHE_TTL_S)
        return [row for _, row in sorted(got.items()) if row is not None]

    def _read_rows(self, sha256: str, idxs: list[int]) -> dict[int, bytes]:
        """Rows `idxs` of a blob in one query, in binary: the text protocol sends a bytea as
        hex, twice its bytes, which PostgreSQL encodes and psycopg decodes (about 2.5x the CPU
        on statesvc's side). Errors are raised as SQLAlchemy's, as the other reads'."""
        sql = (f"SELECT idx, data FROM {BlobChunkRow.__tablename__} "
               "WHERE sha256 = %s AND idx = ANY(%s)")
        with self.engine.connect() as conn:
            db = conn.connection.driver_connection
            assert db is not None  # a checked-out connection
            try:
                with db.cursor(binary=True) as cur:
                    cur.execute(sql, (sha256, idxs))
                    return {int(i): bytes(d) for i, d in cur}
            except psycopg.Error as err:
                raise exc.DBAPIError.instance(sql, None, err, psycopg.Error) from err

    def _keep(self, sha256: str, rows: dict[int, bytes], expires: float) -> None:
        with self._lock:
            for i, row in sorted(rows.items()):
                self._rows.put((sha256, i), (row, expires))

    def committed(self, sha256: str, data: bytes | bytearray) -> None:
        """A blob this instance has just committed with its event: its size and rows are kept
        as if read, so the fleet's fetches right after the load (the first one included) cost
        no database round trip."""
        with self._lock:
            self._sizes[sha256] = len(data)
        self._keep(sha256, {r["idx"]: r["data"] for r in chunk_rows(sha256, data)},
                   time.monotonic() + CACHE_TTL_S)

    def _forget(self, sha256: str) -> None:
        with self._lock:
            self._rows.retain(lambda key: key[0] != sha256)

    def put(self, data: bytes | bytearray, sha256: str | None = None, *, overwrite: bool = False,
            progress: Callable[[], None] = lambda: None) -> tuple[str, bool]:
        """Rewrite the chunks of a stored blob (a repair, `overwrite`). New blobs are not put
        here: the event store writes them with their event."""
        sha256 = sha256 or hashlib.sha256(data).hexdigest()
        if not overwrite:
            raise ValueError("new blobs are written with their event (NewBlob.data)")
        with self.engine.begin() as conn:
            conn.execute(delete(BlobChunkRow).where(BlobChunkRow.sha256 == sha256))
            conn.execute(insert(BlobChunkRow), chunk_rows(sha256, data))
        self._forget(sha256)
        return sha256, True

    def size(self, sha256: str) -> int:
        size = self._size(sha256)
        if size is None:
            raise KeyError(f"no blob {sha256}")
        return size

    def read_chunk(self, sha256: str, offset: int, length: int = MAX_BLOB_CHUNK) -> bytes:
        length = min(length, MAX_BLOB_CHUNK, max(0, self.size(sha256) - offset))
        if length <= 0:
            return b""
        first, last = offset // CHUNK_BYTES, (offset + length - 1) // CHUNK_BYTES
        data = b"".join(self._chunk_rows(sha256, first, last))
        start = offset - first * CHUNK_BYTES
        return data[start:start + length]

    def verify(self, sha256: str) -> bool:
        """True when the blob exists and its chunks hash to its name."""
        h, n = hashlib.sha256(), 0
        q = (select(BlobChunkRow.data).where(BlobChunkRow.sha256 == sha256)
             .order_by(BlobChunkRow.idx))
        with self.engine.connect() as conn:
            for chunk in conn.execution_options(yield_per=8).execute(q).scalars():
                h.update(chunk)
                n += 1
        return n > 0 and h.hexdigest() == sha256

    def remove(self, sha256: str) -> None:
        """Nothing to remove: a blob whose event was not committed was never written."""

    def all(self) -> set[str]:
        with self.engine.begin() as conn:
            return set(conn.execute(select(BlobRow.sha256)).scalars())

    def sweep(self, keep: set[str], *, log_complete: bool = True) -> list[str]:
        """No orphans: blobs are committed with their events."""
        return []
