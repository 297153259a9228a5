"""Blobs in the database (PostgreSQL): any statesvc instance on the log serves any blob.

The bytes are written by the event store in the transaction of the event that first names
them (`NewBlob.data`), in CHUNK_BYTES rows of `blob_chunks`: no blob exists without its event,
so there is nothing to sweep, and no instance can delete what another is about to commit.
"""
from __future__ import annotations

import hashlib
from typing import Callable

from sqlalchemy import Engine, delete, insert, select

from shared.config import MAX_BLOB_CHUNK
from statesvc.models import BlobChunkRow, BlobRow
from statesvc.pgstore import CHUNK_BYTES, chunk_rows


class LogBlobStore:
    """The blob store's interface (statesvc/blobs.py) over the `blobs` and `blob_chunks`
    tables."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def has(self, sha256: str) -> bool:
        q = select(BlobRow.sha256).where(BlobRow.sha256 == sha256)
        with self.engine.begin() as conn:
            return conn.execute(q).first() is not None

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
        return sha256, True

    def size(self, sha256: str) -> int:
        with self.engine.begin() as conn:
            return int(conn.execute(select(BlobRow.size).where(BlobRow.sha256 == sha256))
                       .scalar_one())

    def read_chunk(self, sha256: str, offset: int, length: int = MAX_BLOB_CHUNK) -> bytes:
        length = min(length, MAX_BLOB_CHUNK)
        if length <= 0:
            return b""
        first, last = offset // CHUNK_BYTES, (offset + length - 1) // CHUNK_BYTES
        q = (select(BlobChunkRow.data).where(BlobChunkRow.sha256 == sha256,
                                             BlobChunkRow.idx.between(first, last))
             .order_by(BlobChunkRow.idx))
        with self.engine.begin() as conn:
            data = b"".join(bytes(d) for d in conn.execute(q).scalars())
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

    def sweep(self, keep: set[str]) -> list[str]:
        """No orphans: blobs are committed with their events."""
        return []
