"""A replica's blob cache as peers read it (shared/blobserve.py's ChunkSource over real files):
chunks of what it holds, and `not_found`, never an internal error, for a file that went away
while a peer read it (a cached blob found damaged is removed and fetched again)."""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from computed.weights import BlobCache
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
