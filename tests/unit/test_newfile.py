"""computed/residency/direct_write.py on real files: whole blobs of any size past the page cache, and the
page-cache path where the file system refuses O_DIRECT."""
from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path

import pytest

import computed.residency.direct_write as newfile
from computed.residency.direct_write import NewFileWriter


def _bytes(size: int) -> bytes:
    return (hashlib.sha256(str(size).encode()).digest() * (size // 32 + 1))[:size]


@pytest.mark.parametrize("size", [0, 1, 4096, 8192 * 3 + 17])
def test_any_size_is_written_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   size: int) -> None:
    """Pieces of DIRECT_CHUNK padded to DIRECT_ALIGN, then cut: empty, under a block, one
    block, several pieces and a tail."""
    monkeypatch.setattr(newfile, "DIRECT_CHUNK", 8192)
    writer, pieces = NewFileWriter(), []
    data = _bytes(size)
    writer.write(tmp_path / "f", data, progress=lambda: pieces.append(1))
    assert (tmp_path / "f").read_bytes() == data
    assert writer.direct  # this file system took O_DIRECT (ext4, xfs, btrfs, tmpfs >= 6.6)
    assert len(pieces) == -(-size // 8192)
    writer.write(tmp_path / "f", b"shorter")  # an existing file is replaced, not overlaid
    assert (tmp_path / "f").read_bytes() == b"shorter"


def test_a_bytearray_and_a_memoryview_are_written_as_bytes(tmp_path: Path) -> None:
    data = _bytes(10_001)
    NewFileWriter().write(tmp_path / "a", bytearray(data))
    NewFileWriter().write(tmp_path / "v", memoryview(data)[1:])
    assert (tmp_path / "a").read_bytes() == data and (tmp_path / "v").read_bytes() == data[1:]


def test_where_the_file_system_refuses_o_direct_the_page_cache_is_used(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Linux before 6.6 refuses O_DIRECT on tmpfs with EINVAL at open (this kernel may take
    it, so the refusal is made here): the file goes through the page cache, and the next
    one does not try O_DIRECT again."""
    real_open, tried = os.open, []

    def no_direct(path: str, flags: int, mode: int = 0o777) -> int:
        if flags & os.O_DIRECT:
            tried.append(path)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, mode)

    monkeypatch.setattr(newfile.os, "open", no_direct)
    writer = NewFileWriter()
    for name, size in (("a", 10_000), ("b", 20_000)):
        writer.write(tmp_path / name, _bytes(size))
        assert (tmp_path / name).read_bytes() == _bytes(size)
    assert not writer.direct and len(tried) == 1


def test_other_errors_pass_through(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        NewFileWriter().write(tmp_path / "no-such-dir" / "f", b"x")
