"""Reading files that outside input names: regular files only, never past a limit."""
from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO


class FileError(ValueError):
    """Not a regular file, or larger than the limit."""


def open_regular(path: Path) -> BinaryIO:
    """Open a regular file for reading; a device, FIFO or directory is refused without
    blocking (the open of a FIFO waits for a writer; O_NONBLOCK does not)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise FileError(f"{path} is not a regular file")
    return os.fdopen(fd, "rb")


def read_regular(path: Path, limit: int) -> bytes:
    """All of a regular file, refused when it holds more than `limit` bytes, whatever its
    size claims (files under /proc claim 0). OSError passes through."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise FileError(f"{path} is {size} bytes, above the {limit}-byte limit")
        data = f.read(size + 1)
        if len(data) <= size:  # the size was honest: all of it in one read
            return data
        buf = bytearray(data)  # it was not: read on in chunks, up to the limit
        while len(buf) <= limit and (chunk := f.read(1 << 20)):
            buf += chunk
    if len(buf) > limit:
        raise FileError(f"{path} holds more than {limit} bytes")
    return bytes(buf)
