"""Reading files that outside input names: regular files only, never past a limit, and (for
paths that must stay under some directories) never from outside them."""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import BinaryIO

MAX_SYMLINKS = 40  # as the kernel's path walk (ELOOP beyond)
_NO_WAIT = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


class FileError(ValueError):
    """Not a regular file, or larger than the limit."""


class OutsideRoots(FileError):
    """A path that leads out of every root, as named or through a symlink."""

    def __init__(self, path: Path, resolved: Path) -> None:
        via = "" if resolved == path else f" (it resolves to {resolved})"
        super().__init__(f"{path} is outside the roots{via}")
        self.path = path
        self.resolved = resolved


def open_regular(path: Path) -> BinaryIO:
    """Open a regular file for reading; a device, FIFO or directory is refused without
    blocking (the open of a FIFO waits for a writer; O_NONBLOCK does not)."""
    return _regular(os.open(path, os.O_RDONLY | os.O_NONBLOCK), path)


def _regular(fd: int, path: Path) -> BinaryIO:
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise FileError(f"{path} is not a regular file")
    return os.fdopen(fd, "rb")


def read_regular(path: Path, limit: int) -> bytes:
    """All of a regular file, refused when it holds more than `limit` bytes, whatever its
    size claims (files under /proc claim 0). OSError passes through."""
    with open_regular(path) as f:
        return read_limited(f, limit, path)


def read_limited(f: BinaryIO, limit: int, path: Path) -> bytes:
    """All of open file `f`, refused when it holds more than `limit` bytes."""
    size = os.fstat(f.fileno()).st_size
    if size > limit:
        raise FileError(f"{path} is above the {limit}-byte limit")
    data = f.read(size + 1)
    if len(data) <= size:  # the size was honest: all of it in one read
        return data
    buf = bytearray(data)  # it was not: read on in chunks, up to the limit
    while len(buf) <= limit and (chunk := f.read(1 << 20)):
        buf += chunk
    if len(buf) > limit:
        raise FileError(f"{path} holds more than {limit} bytes")
    return bytes(buf)


class Beneath:
    """Opens paths only under `roots` (absolute, symlinks resolved), race-free.

    Checking a path and then opening it by name lets a symlink swapped in between lead
    anywhere. Here every component is opened relative to the directory handle of the one
    before it, from a root's handle down, with O_NOFOLLOW, so nothing the kernel resolves can
    leave the root. A symlink met on the way is read (readlink) and resolved here: its target
    joins the rest of the path, `..` is taken lexically, and the result must lie under a root,
    from whose handle the walk starts again. What is opened is what was checked, and a
    symlink that stays under the roots (as in Hugging Face's cache, whose snapshot files link
    to ../../blobs) still works. `Beneath((Path("/"),))` confines nothing."""

    def __init__(self, roots: tuple[Path, ...]) -> None:
        self.roots = roots

    def open_dir(self, path: Path) -> tuple[int, Path]:
        """The fd of directory `path` (absolute; the caller closes the fd) and its path with
        symlinks resolved. OSError (ENOENT, ENOTDIR, EACCES, ELOOP ...) and OutsideRoots pass
        through."""
        return self._walk(path, _joined(path, "."), directory=True)

    def open_file(self, dir_fd: int, dir_path: Path, name: str) -> BinaryIO:
        """Regular file `name` in a directory from `open_dir`, opened from its fd; a symlink
        is resolved as `open_dir` does. FileError for anything but a regular file."""
        fd = _open_here(name, _NO_WAIT, dir_fd)
        if isinstance(fd, str):
            fd, _ = self._walk(dir_path / name, _joined(dir_path, fd), directory=False)
        return _regular(fd, dir_path / name)

    def _root_of(self, path: Path) -> Path | None:
        under = [r for r in self.roots if path.is_relative_to(r)]
        return max(under, key=lambda r: len(r.parts)) if under else None

    def _walk(self, named: Path, path: Path, *, directory: bool) -> tuple[int, Path]:
        """Open `path` (absolute, no `..`) under its root; `named` is what the caller asked
        for, for messages."""
        for _ in range(MAX_SYMLINKS + 1):
            root = self._root_of(path)
            if root is None:
                raise OutsideRoots(named, path)
            fd = os.open(root, _DIR)
            rest = path.relative_to(root).parts
            try:
                for i, name in enumerate(rest):
                    last = i == len(rest) - 1
                    flags = _DIR if directory or not last else _NO_WAIT
                    child = _open_here(name, flags, fd)
                    if isinstance(child, str):
                        path = _joined(root.joinpath(*rest[:i]), child, *rest[i + 1:])
                        break
                    os.close(fd)
                    fd = child
                else:
                    found, fd = fd, -1
                    return found, path
            finally:
                if fd >= 0:
                    os.close(fd)
        raise OSError(errno.ELOOP, f"more than {MAX_SYMLINKS} symbolic links on the way to "
                      f"{named}")


def _open_here(name: str, flags: int, dir_fd: int) -> int | str:
    """Open `name` in `dir_fd` without following a symlink: its fd, or, when it is a
    symlink, the symlink's target. OSError for anything else that fails."""
    try:
        return os.open(name, flags | os.O_NOFOLLOW, dir_fd=dir_fd)
    except OSError:
        try:
            return os.readlink(name, dir_fd=dir_fd)
        except OSError:
            pass
        raise


def _joined(base: Path, target: str, *rest: str) -> Path:
    """`target` (relative to `base`, or absolute) then `rest`, with `..` taken lexically."""
    return Path("/" + os.path.normpath(os.path.join(base, target, *rest)).lstrip("/"))
