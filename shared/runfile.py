"""A replica's run file: how the operator's own side knows what to kill and how to restart it.

`computed serve` writes `<cache-dir>/run.json` when it is listening: its pid, the exact
command line (/proc/self/cmdline), working directory, listen address, replica id and model.
The file is written atomically, mode 0600, in a directory the operator chose. Drills trust
this file (never what a replica reports over the network), and only after checking that it
belongs to the user running the drill, is writable by no one else, and that the pid still runs
that very command line (a reused pid runs something else).

`statesvc serve` writes one too, `<data-dir>/run.json` (replica_id "statesvc", listen its
control address, no model), for `loractl drill --kill-statesvc DATA_DIR`.
"""
from __future__ import annotations

import json
import os
import stat
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from shared.files import FileError, open_regular, read_limited

RUN_FILE = "run.json"
STATESVC_RUN_ID = "statesvc"  # the replica_id of a statesvc instance's run file (its data dir)
MAX_RUN_FILE_BYTES = 1 << 20


class RunFileError(ValueError):
    """A run file that is missing, unreadable, not trusted, or names no running replica."""


@dataclass(frozen=True)
class RunFile:
    replica_id: str
    pid: int
    argv: tuple[str, ...]
    cwd: str
    listen: str
    model: str

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "argv": list(self.argv)}


def own_cmdline() -> tuple[str, ...]:
    """This process's exact command line, as /proc shows it (interpreter included)."""
    return cmdline(os.getpid())


def cmdline(pid: int) -> tuple[str, ...]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        raw = f.read()
    return tuple(os.fsdecode(part) for part in raw.split(b"\0")[:-1])


def write(path: Path, run: RunFile) -> None:
    """Replace `path` atomically with `run`, readable by this user only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(run.to_json(), f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read(path: Path) -> RunFile:
    """The run file at `path`, if this user wrote it and nobody else can change it."""
    try:
        with open_regular(path) as f:
            st = os.fstat(f.fileno())
            if st.st_uid != os.getuid() or st.st_mode & 0o022:
                raise RunFileError(f"{path} is not trusted: it must belong to you (uid "
                                   f"{os.getuid()}, not {st.st_uid}) and be writable by you "
                                   f"alone (mode {stat.S_IMODE(st.st_mode):o})")
            raw = read_limited(f, MAX_RUN_FILE_BYTES, path)
    except FileError as exc:
        raise RunFileError(f"{exc}: not a run file") from None
    except OSError as exc:
        raise RunFileError(f"cannot open the run file {path} ({exc.strerror}); pass the "
                           "replica's <cache-dir>/run.json with --run-file") from None
    try:
        data = json.loads(raw)
        run = RunFile(str(data["replica_id"]), int(data["pid"]),
                      tuple(str(a) for a in data["argv"]), str(data["cwd"]),
                      str(data["listen"]), str(data["model"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise RunFileError(f"{path} is not a valid run file ({exc})") from None
    if run.pid <= 1 or not run.argv:
        raise RunFileError(f"{path} names no process (pid {run.pid}, argv {list(run.argv)})")
    return run


def check_running(run: RunFile, path: Path) -> None:
    """Refuse unless `run.pid` is alive and runs exactly `run.argv` (so a reused pid is safe)."""
    try:
        now = cmdline(run.pid)
    except OSError:
        raise RunFileError(f"replica {run.replica_id}'s process {run.pid} (from {path}) is "
                           "not running; start the replica, or pass the run file of the one "
                           "that runs") from None
    if now != run.argv:
        raise RunFileError(f"process {run.pid} (from {path}) no longer runs replica "
                           f"{run.replica_id}: its command line is {list(now)[:4]}...; the pid "
                           "was reused, so nothing is killed")
