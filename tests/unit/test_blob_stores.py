"""The blob store contract, one subclass per backend (files beside SQLite, chunks in
PostgreSQL), each opened with its event store by `open_log`."""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterator

import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError

from shared.config import MAX_BLOB_CHUNK
from statesvc.persistence import open_log
from statesvc.persistence.base import BlobStore, EventStore, NewBlob, NewEvent
from statesvc.persistence.postgres_blobs import CHUNK_BYTES, LogBlobStore
from statesvc.persistence.sqlite import FileBlobStore, sqlite_url

# larger than a chunk row and than a `blob` reply: reads cross rows and are capped
DATA = bytes(range(256)) * ((MAX_BLOB_CHUNK + CHUNK_BYTES) // 256 + 3)
SHA = hashlib.sha256(DATA).hexdigest()


def ev(seq: int, event_id: str | None = None) -> NewEvent:
    return NewEvent(seq, event_id or f"00000000-0000-4000-8000-{seq:012d}", "adapter.loaded",
                    {"name": f"a{seq}"}, "tester")


def stored(store: EventStore, blobs: BlobStore, data: bytes, seq: int,
           event_id: str | None = None) -> str:
    """Store a new blob with the event that names it, as the service does: a file put before
    its event, or bytes written in the event's transaction (`in_log`)."""
    sha = hashlib.sha256(data).hexdigest()
    if not blobs.in_log:
        blobs.put(data, sha)
    store.append([ev(seq, event_id)],
                 blobs=[NewBlob(sha, len(data), seq, data if blobs.in_log else None)])
    if blobs.in_log:
        blobs.committed(sha, data)
    return sha


class BlobStoreContract:
    def url(self, tmp_path: Path) -> str:
        raise NotImplementedError

    def damage(self, blobs: BlobStore, sha256: str) -> None:
        """Change the stored bytes of a blob behind the store's back (a bad disk)."""
        raise NotImplementedError

    @pytest.fixture
    def log(self, tmp_path: Path) -> Iterator[tuple[EventStore, BlobStore]]:
        store, blobs = open_log(self.url(tmp_path))
        yield store, blobs
        store.close()

    def test_a_stored_blob_reads_back_in_chunks(self, log: tuple[EventStore, BlobStore]) -> None:
        store, blobs = log
        assert stored(store, blobs, DATA, 1) == SHA
        assert blobs.has(SHA) and blobs.size(SHA) == len(DATA) and blobs.verify(SHA)
        got = b"".join(blobs.read_chunk(SHA, off, 700_001)
                       for off in range(0, len(DATA), 700_001))
        assert got == DATA and blobs.read_chunk(SHA, len(DATA)) == b""
        assert blobs.read_chunk(SHA, 5, 10) == DATA[5:15]
        assert blobs.all() == {SHA} and store.blob_hashes() == {SHA}

    def test_a_read_is_at_most_one_blob_chunk(self, log: tuple[EventStore, BlobStore]) -> None:
        store, blobs = log
        stored(store, blobs, DATA, 1)
        assert blobs.read_chunk(SHA, 1, 2 * len(DATA)) == DATA[1:1 + MAX_BLOB_CHUNK]

    def test_sizes_of_several_blobs(self, log: tuple[EventStore, BlobStore]) -> None:
        store, blobs = log
        shas = [stored(store, blobs, bytes([i]) * (1000 * i + 1), i) for i in (1, 2, 3)]
        assert [blobs.size(s) for s in shas] == [1001, 2001, 3001]
        assert blobs.all() == set(shas) and all(blobs.verify(s) for s in shas)

    def test_an_unknown_blob(self, log: tuple[EventStore, BlobStore]) -> None:
        _, blobs = log
        assert not blobs.has("cd" * 32) and not blobs.verify("cd" * 32)
        assert blobs.all() == set()

    def test_verify_reads_the_stored_bytes_and_overwrite_repairs_them(
            self, log: tuple[EventStore, BlobStore]) -> None:
        """`verify` never trusts what is kept in memory; `put(..., overwrite=True)` (a load
        that finds its stored copy damaged) rewrites the same bytes under the same name."""
        store, blobs = log
        stored(store, blobs, DATA, 1)
        self.damage(blobs, SHA)
        assert not blobs.verify(SHA)
        assert blobs.put(DATA, SHA, overwrite=True) == (SHA, True)
        assert blobs.verify(SHA) and blobs.read_chunk(SHA, 0, 100) == DATA[:100]
        assert blobs.size(SHA) == len(DATA)

    def test_a_blob_whose_event_failed_is_gone_after_remove(
            self, log: tuple[EventStore, BlobStore]) -> None:
        """The service removes the new blobs of a batch whose append failed: none stays."""
        store, blobs = log
        stored(store, blobs, b"first", 1)
        with pytest.raises(IntegrityError):  # the event_id is taken: nothing committed
            stored(store, blobs, b"second", 2, event_id=ev(1).event_id)
        sha = hashlib.sha256(b"second").hexdigest()
        assert sha not in store.blob_hashes()
        blobs.remove(sha)
        assert not blobs.has(sha) and blobs.all() == {hashlib.sha256(b"first").hexdigest()}

    def test_sweep_keeps_every_blob_an_event_names(
            self, log: tuple[EventStore, BlobStore]) -> None:
        store, blobs = log
        stored(store, blobs, DATA, 1)
        assert blobs.sweep(store.blob_hashes()) == []
        assert blobs.sweep(store.blob_hashes(), log_complete=False) == []
        assert blobs.verify(SHA)


class TestFileBlobStore(BlobStoreContract):
    def url(self, tmp_path: Path) -> str:
        return sqlite_url(tmp_path)

    def damage(self, blobs: BlobStore, sha256: str) -> None:
        assert isinstance(blobs, FileBlobStore)
        blobs.path(sha256).write_bytes(b"x" * 10)


class TestLogBlobStore(BlobStoreContract):
    """The same contract on a real PostgreSQL server (testkit/pg.py), one database per test."""

    @pytest.fixture(autouse=True)
    def _database(self, pg_url: str) -> None:
        self.pg_url = pg_url

    def url(self, tmp_path: Path) -> str:
        return self.pg_url

    def damage(self, blobs: BlobStore, sha256: str) -> None:
        assert isinstance(blobs, LogBlobStore)
        with blobs.engine.begin() as conn:
            conn.execute(text("UPDATE blob_chunks SET data = 'x' WHERE sha256 = :s AND idx = 0"),
                         {"s": sha256})
