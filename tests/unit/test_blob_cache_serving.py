"""A replica's blob cache as peers read it (shared/blobserve.py's ChunkSource over real files):
chunks of what it holds, and `not_found`, never an internal error, for a file that went away
while a peer read it (a cached blob found damaged is removed and fetched again); blobs held in
memory until written; and the files within --blob-cache-mb, the blobs in use kept."""
from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import pytest

from computed.residency.blob_cache import BlobCache
from shared.blobserve import read_chunk
from shared.client import ControlClient
from shared.errors import CodedError


def test_a_cached_blob_is_served_in_chunks_and_one_removed_meanwhile_is_not_found(
        tmp_path: Path) -> None:
    cache = BlobCache(tmp_path / "blobs", ControlClient("tcp://127.0.0.1:9"))
    data = bytes(range(256)) * 40
    sha = hashlib.sha256(data).hexdigest()
    cache.path(sha).write_bytes(data)
    got = read_chunk(cache, {"sha256": sha, "offset": 1000, "length": 3000})
    assert (got["size"], got["data"]) == (len(data), data[1000:4000])
    assert cache.has(sha) and not cache.has("../" + sha[3:])
    cache.path(sha).unlink()  # between a peer's `has` and its read
    for read in (lambda: cache.size(sha), lambda: cache.read_chunk(sha, 0, 10)):
        with pytest.raises(CodedError) as gone:
            read()
        assert gone.value.code == "not_found" and gone.value.field == "args.sha256"
    with pytest.raises(CodedError) as missing:
        read_chunk(cache, {"sha256": sha, "offset": 0, "length": 10})
    assert missing.value.code == "not_found"


class _Fetched(BlobCache):
    """A cache whose fetches return `blobs` (the fetch over ZeroMQ is tested with real
    services in tests/integration/test_replica.py and test_peer_blobs.py)."""

    def __init__(self, root: Path, blobs: dict[str, bytes], *,
                 limit_bytes: int | None = None) -> None:
        super().__init__(root, ControlClient("tcp://127.0.0.1:9"), limit_bytes=limit_bytes)
        self.blobs = blobs
        self.writer_may_go = threading.Event()  # holds the cache writer until set

    def _fetch(self, client: object, sha256: str, source: str, *, size: object = None) -> bytes:
        return self.blobs[sha256]

    def _write(self, sha256: str, data: bytes) -> None:
        if threading.current_thread() is self._writer:
            self.writer_may_go.wait()
        super()._write(sha256, data)


def test_a_fetched_blob_is_served_from_memory_until_its_file_is_written(tmp_path: Path) -> None:
    data = bytes(range(256)) * 64
    sha = hashlib.sha256(data).hexdigest()
    cache = _Fetched(tmp_path / "blobs", {sha: data})
    assert cache.get(sha) == data  # the writer waits: the blob stays in memory
    assert sha in cache.unwritten and not cache.path(sha).exists()
    assert cache.get(sha) == data and cache.fetches == 1  # the held bytes, not a fetch
    assert cache.has(sha) and cache.size(sha) == len(data)
    assert cache.read_chunk(sha, 100, 50) == data[100:150]
    cache.writer_may_go.set()
    cache.close()  # writes what is held
    assert cache.path(sha).read_bytes() == data and not cache.unwritten
    assert not list((tmp_path / "blobs").glob("*.tmp*"))
    assert cache.get(sha) == data and cache.fetches == 1  # now from the file


def test_past_the_bound_a_fetch_writes_its_own_file(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import computed.residency.blob_cache as weights
    small, big = b"s" * 1000, b"b" * 5000
    shas = {hashlib.sha256(b).hexdigest(): b for b in (small, big)}
    monkeypatch.setattr(weights, "MAX_UNWRITTEN_BYTES", 4000)
    cache = _Fetched(tmp_path / "blobs", shas)
    s_sha, b_sha = (hashlib.sha256(b).hexdigest() for b in (small, big))
    cache.unwritten["f" * 64] = b"x" * 3500  # the writer is behind by 3,500 bytes
    assert cache.get(s_sha) == small and cache.path(s_sha).is_file()  # 4,500 > 4,000: inline
    cache.unwritten.clear()
    assert cache.get(b_sha) == big and cache.path(b_sha).is_file()  # alone above the bound
    assert cache._writer is None  # neither went through the writer
    cache.close()


def test_a_cache_file_is_written_whole_and_flushed(tmp_path: Path) -> None:
    data = bytes(range(256)) * 9000 + b"tail"  # 2.3 MB, not a whole number of blocks
    sha = hashlib.sha256(data).hexdigest()
    cache = _Fetched(tmp_path / "blobs", {sha: data})
    cache.writer_may_go.set()
    assert cache.get(sha) == data
    cache.close()
    assert cache.path(sha).read_bytes() == data
    assert not list((tmp_path / "blobs").glob("*.tmp*"))


def test_the_files_stay_within_the_bound_least_recently_used_out_those_in_use_kept(
        tmp_path: Path) -> None:
    blobs = {hashlib.sha256(d).hexdigest(): d for d in (bytes([i]) * 1000 for i in range(5))}
    s0, s1, s2, s3, s4 = blobs
    cache = _Fetched(tmp_path / "blobs", blobs, limit_bytes=2500)
    cache.writer_may_go.set()

    def fetched(*shas: str) -> set[str]:
        for sha in shas:
            assert cache.get(sha) == blobs[sha]
        cache.close()  # every file written
        return {p.name for p in (tmp_path / "blobs").iterdir()}

    cache.keep(frozenset({s0}))  # in a slot: kept whatever the bound
    assert fetched(s0, s1, s2) == {s0, s2}  # s1 least recently used, s2 just written
    assert fetched(s0, s3) == {s0, s3}  # s0 read again: s2 is the least recently used
    cache.keep(frozenset())  # s0 unloaded: the least recently used now
    assert fetched(s4) == {s3, s4} and cache.evictions == 3
    assert cache.get(s0) == blobs[s0] and cache.fetches == 6  # removed: fetched again
    cache.close()
    # a replica restarted on the cache dir takes its files in their order of last use
    again = _Fetched(tmp_path / "blobs", blobs, limit_bytes=1500)
    again.keep(frozenset())
    assert {p.name for p in (tmp_path / "blobs").iterdir()} == {s0}
