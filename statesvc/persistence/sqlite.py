"""The SQLite backend: the event store (`SqliteEventStore`) and the file blob store
(`FileBlobStore`) of one statesvc, in its data dir.

`SqliteEventStore` is SQLAlchemy 2 over SQLite in WAL mode with synchronous=FULL, one
writer. `append` writes a whole batch of events in one `BEGIN IMMEDIATE` transaction and
returns only once it is durable, so concurrent commands are committed together (group
commit).

The write path (`append`, and `by_event_ids` once per batch) runs plain SQL on one
connection the store keeps checked out of the engine's pool: SQLAlchemy's
per-statement work cost more CPU than SQLite's commit. Its errors are raised as
SQLAlchemy's (IntegrityError, OperationalError, ...), like the rest of the store's.

A SQLite log also keeps a high-water mark (`HighWater`, state.db.head): the head after
its last commit. A log found behind it at open lost events (most likely its state.db-wal),
and is refused before anything is written to it.

`FileBlobStore` keeps adapter weights by sha256 under <data-dir>/blobs.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import sqlite3
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Collection, Iterator, Sequence

from sqlalchemy import Engine, create_engine, event, exc, inspect, make_url, text

from shared.config import MAX_BLOB_CHUNK
from shared.errors import CodedError
from shared.events import Event
from shared.lru import ByteLRU
from statesvc.persistence.base import (Begun, NewBlob, NewEvent, Snapshot, SqlReads, StoreError,
                                       upgrade_to_head, utc_now)

log = logging.getLogger("statesvc")


def recovery_steps(data_dir: Path) -> str:
    """What an operator can do about a log that lost events or a damaged database file."""
    return (f"To recover: restore state.db together with its state.db-wal into {data_dir} "
            "(from a backup, or the copy they came from) and start again; or, if those events "
            f"are gone for good, move {data_dir} aside, start statesvc with a new --data-dir, "
            "run `loractl pool init` and `loractl load` again, and restart every replica with "
            "an empty --cache-dir (they refuse a new log while they hold the old one).")


class HighWater:
    """The head after the last commit, in a small file next to the database (state.db.head).

    Written in place with a plain write after every commit, never synced: it survives a
    killed process (which is what a deleted state.db-wal needs to be noticed) at no fsync per
    commit; a power loss is SQLite's to cover (synchronous=FULL), and a mark it leaves behind
    is only lower. The file is created by the first commit."""

    WIDTH = 20

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def read(self) -> int | None:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return None
        if not raw.strip(b"\0"):  # created, then a power loss before its data reached the disk
            return None
        if not re.fullmatch(rb" *[0-9]{1,%d}\n" % self.WIDTH, raw):
            raise StoreError(f"{self.path} does not hold a seq (it holds {raw[:40]!r}); statesvc "
                             "writes the head there after every commit and checks at start that "
                             "the log is not behind it. If state.db is complete, delete "
                             f"{self.path.name} and start again.")
        return int(raw)

    def write(self, seq: int) -> None:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
        os.pwrite(self._fd, b"%*d\n" % (self.WIDTH, seq), 0)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def sqlite_url(data_dir: Path) -> str:
    return f"sqlite:///{Path(data_dir).resolve() / 'state.db'}"


def make_engine(url: str) -> Engine:
    """An engine whose connections use WAL and synchronous=FULL; `write_tx` begins IMMEDIATE."""
    # two connections: the one SqliteEventStore holds for its write path, one for reads
    engine = create_engine(url, pool_size=2, max_overflow=0)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # we issue BEGIN ourselves
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=FULL")
        cur.execute("PRAGMA busy_timeout=5000")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        # writers take the write lock up front; readers need no lock in WAL mode
        immediate = conn.get_execution_options().get("immediate", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

    return engine


def write_tx(engine: Engine) -> Any:
    """A transaction that holds SQLite's write lock from its BEGIN (BEGIN IMMEDIATE)."""
    return engine.execution_options(immediate=True).begin()



_INSERT_EVENT = ("INSERT INTO events (seq, event_id, type, payload, recorded_at, actor) "
                 "VALUES (?, ?, ?, ?, ?, ?)")
_INSERT_BLOB = ("INSERT INTO blobs (sha256, size, first_seq, created_at) VALUES (?, ?, ?, ?) "
                "ON CONFLICT DO NOTHING")
_INSERT_SNAPSHOT = "INSERT INTO snapshots (seq, state, digest, created_at) VALUES (?, ?, ?, ?)"


class SqliteEventStore(SqlReads):
    shared = False

    @contextmanager
    def turn(self, since: int, event_ids: Collection[str]) -> Iterator[Begun]:
        # one writer, its own thread: nothing to take turns with or to catch up on
        yield Begun([], self.by_event_ids(event_ids))

    def __init__(self, url: str, *, migrate: bool = True) -> None:
        database = make_url(url).database
        path = Path(database).resolve() if database and database != ":memory:" else None
        self.high_water = None if path is None else HighWater(path.with_name(path.name + ".head"))
        self.recorded_head = None if self.high_water is None else self.high_water.read()
        self.engine = make_engine(url)
        try:
            # before anything is written: a log behind its high-water mark stays as it is
            head = self._stored_head()
            if self.high_water is not None and self.recorded_head is not None \
                    and head < self.recorded_head:
                raise StoreError(
                    f"the log in {path} ends at seq {head}, but it held events up to seq "
                    f"{self.recorded_head} ({self.recorded_head - head} lost; the head after "
                    f"every commit is kept in {self.high_water.path}): most likely "
                    "state.db-wal, SQLite's write-ahead log, was deleted or not copied along "
                    "with state.db. "
                    "statesvc serves no shorter log, since replicas would take other events "
                    "under the same seqs, and changed nothing. A copy that ends before seq "
                    f"{self.recorded_head} is refused as well. "
                    + recovery_steps(self.high_water.path.parent))
            if migrate:
                with write_tx(self.engine) as conn:  # SQLite's write lock: one migrator
                    upgrade_to_head(conn)
            # the write path's connection, set up by make_engine's connect hook (WAL,
            # synchronous=FULL, no implicit transactions); held until close
            self._writer = self.engine.raw_connection()
        except exc.DatabaseError as err:
            self.engine.dispose()
            where = path or url
            if isinstance(err.orig, sqlite3.OperationalError):
                raise StoreError(f"cannot open the event store {where}: {err.orig}; check that "
                                 "the path exists and statesvc may read and write it") from None
            data_dir = path.parent if path is not None else Path(".")
            raise StoreError(f"{where} is not a readable SQLite database ({err.orig}): it is "
                             "damaged or not statesvc's. statesvc changed nothing. "
                             + recovery_steps(data_dir)) from None
        except StoreError:
            self.engine.dispose()
            raise
        self._db: sqlite3.Connection = self._writer.driver_connection  # type: ignore[assignment]

    def _stored_head(self) -> int:
        """The head as stored, before migrations: 0 where there is no events table yet."""
        with self.engine.begin() as conn:
            if not inspect(conn).has_table("events"):
                return 0
            return int(conn.execute(text("SELECT coalesce(max(seq), 0) FROM events")).scalar_one())

    def append(self, events: Sequence[NewEvent], *, blobs: Sequence[NewBlob] = (),
               snapshots: Sequence[Snapshot] = ()) -> list[Event]:
        now = utc_now()
        # the payload as SQLAlchemy's JSON type stores it (json.dumps), so reads decode it
        rows = [(e.seq, e.event_id, e.type, json.dumps(e.payload), now, e.actor) for e in events]
        db, sql = self._db, "BEGIN IMMEDIATE"
        try:
            db.execute(sql)
            try:
                if rows:
                    sql = _INSERT_EVENT
                    db.executemany(sql, rows)
                if blobs:
                    sql = _INSERT_BLOB
                    db.executemany(sql, [(b.sha256, b.size, b.first_seq, now) for b in blobs])
                if snapshots:
                    sql = _INSERT_SNAPSHOT
                    db.executemany(sql, [(s.seq, s.state, s.digest, now) for s in snapshots])
                sql = "COMMIT"
                db.execute(sql)
            except BaseException:
                if db.in_transaction:
                    db.rollback()
                raise
        except sqlite3.Error as err:
            raise exc.DBAPIError.instance(sql, None, err, sqlite3.Error) from err
        if self.high_water is not None and events:
            self.high_water.write(events[-1].seq)
        return [Event(e.seq, e.event_id, e.type, e.payload, now, e.actor) for e in events]

    def by_event_ids(self, event_ids: Collection[str]) -> dict[str, Event]:
        if not event_ids:
            return {}
        ids = tuple(event_ids)
        sql = ("SELECT seq, event_id, type, payload, recorded_at, actor FROM events "
               f"WHERE event_id IN ({','.join('?' * len(ids))})")
        try:
            rows = self._db.execute(sql, ids).fetchall()
        except sqlite3.Error as err:
            raise exc.DBAPIError.instance(sql, None, err, sqlite3.Error) from err
        return {str(r[1]): Event(int(r[0]), str(r[1]), str(r[2]), json.loads(r[3]), str(r[4]),
                                 str(r[5])) for r in rows}

    def close(self) -> None:
        self._writer.close()
        self.engine.dispose()
        if self.high_water is not None:
            self.high_water.close()


# ---- the blob store ------------------------------------------------------------

WRITE_CHUNK = 8 << 20  # blobs are written this much at a time, `progress` between
# new blobs kept in memory at most, in bytes, for the fetches that follow their loads
RECENT_BYTES = 64 << 20


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class StorageError(CodedError):
    """The blob store could not write (code `storage_error`): the message names the cause and
    the fix."""


def _storage_error(exc: OSError, root: Path) -> StorageError:
    what = exc.strerror or str(exc)
    where = Path(exc.filename).parent if exc.filename else root  # the directory that refused
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        fix = f"free space on the filesystem of {where} (or raise its quota or file size limit)"
    elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        fix = (f"make {where} writable by the user statesvc runs as (uid {os.geteuid()}), "
               "on a filesystem mounted read-write")
    else:
        fix = f"check the disk that holds {where}"
    return StorageError("storage_error", f"cannot store the adapter's weights under {root}: "
                        f"{what} [{errno.errorcode.get(exc.errno or 0, exc.errno)}]; nothing "
                        f"was recorded; {fix}, then retry")


class FileBlobStore:
    """Files named by the sha256 of their bytes; written durably before any event names them."""

    in_log = False  # BlobStore: files, `put` before their event

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._root = str(self.root)
        self.tmp = self.root / "tmp"
        self.tmp.mkdir(parents=True, exist_ok=True)
        # new blobs' bytes (guarded by _lock: the blob thread reads them)
        self._recent: ByteLRU[str, bytes] = ByteLRU(RECENT_BYTES, len)
        self._lock = threading.Lock()

    def path(self, sha256: str) -> Path:
        return self.root / sha256[:2] / sha256

    def has(self, sha256: str) -> bool:
        # once per load: plain os.path, without building a Path
        return os.path.isfile(os.path.join(self._root, sha256[:2], sha256))

    def put(self, data: bytes | bytearray, sha256: str | None = None, *, overwrite: bool = False,
            progress: Callable[[], None] = lambda: None) -> tuple[str, bool]:
        """Store `data` durably; returns (sha256, created). An existing blob is not rewritten
        unless `overwrite` (to repair a damaged copy). StorageError when the disk refuses,
        with the temporary file removed. A new blob's bytes are also kept in memory
        (RECENT_BYTES), where the fleet's fetches right after its load read them. The file
        goes through the page cache, which keeps it for later fetches: unlike a replica's
        blob cache (computed/residency/direct_write.py), this store is read again, by every replica that lacks
        a blob (a cold read of a 0.46 MB blob cost 1.1 ms here, 0.08 from the page cache)."""
        sha256 = sha256 or hashlib.sha256(data).hexdigest()
        final = self.path(sha256)
        if final.is_file() and not overwrite:
            return sha256, False
        tmp = self.tmp / f"{sha256}.{os.getpid()}"
        try:
            final.parent.mkdir(exist_ok=True)
            with tmp.open("wb") as f, memoryview(data) as view:
                for start in range(0, len(view), WRITE_CHUNK):
                    f.write(view[start:start + WRITE_CHUNK])
                    progress()
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
            _fsync_dir(final.parent)
        except OSError as exc:  # full, read-only, not permitted: no half-written file stays
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise _storage_error(exc, self.root) from None
        self._keep(sha256, data)
        return sha256, True

    def _keep(self, sha256: str, data: bytes | bytearray) -> None:
        if len(data) <= self._recent.limit:  # larger ones are not kept: no copy for nothing
            with self._lock:  # bytes: the caller's bytearray may change
                self._recent.put(sha256, bytes(data))

    def _held(self, sha256: str) -> bytes | None:
        with self._lock:
            entry = self._recent.get(sha256)
        return None if entry is None else entry.value

    def size(self, sha256: str) -> int:
        held = self._held(sha256)
        return len(held) if held is not None else self.path(sha256).stat().st_size

    def read_chunk(self, sha256: str, offset: int, length: int = MAX_BLOB_CHUNK) -> bytes:
        length = min(length, MAX_BLOB_CHUNK)
        if (held := self._held(sha256)) is not None:
            return held[offset:offset + length]  # the whole blob: the same object, no copy
        with self.path(sha256).open("rb") as f:
            f.seek(offset)
            return f.read(length)

    def verify(self, sha256: str) -> bool:
        """True when the blob exists and its bytes hash to its name."""
        try:
            h = hashlib.sha256()
            with self.path(sha256).open("rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
        except FileNotFoundError:
            return False
        return h.hexdigest() == sha256

    def remove(self, sha256: str) -> None:
        with self._lock:
            self._recent.drop(sha256)
        self.path(sha256).unlink(missing_ok=True)

    def all(self) -> set[str]:
        return {p.name for p in self.root.glob("??/*") if p.is_file()}

    def committed(self, sha256: str, data: bytes | bytearray) -> None:
        """Nothing to keep: `put` kept a new blob's bytes already."""

    def sweep(self, keep: set[str], *, log_complete: bool = True) -> list[str]:
        """Delete blobs no event refers to (left by a crash between blob and event) and temp
        files. Where the log cannot show that it lost no events (`log_complete` False: a data
        dir from before high-water marks), the blobs no event refers to are kept, with a
        warning: a log that lost events would take every blob of theirs for an orphan."""
        for leftover in self.tmp.iterdir():
            leftover.unlink(missing_ok=True)
        orphans = sorted(self.all() - keep)
        if orphans and not log_complete:
            log.warning("keeping %d blob(s) no event refers to: the log has no high-water "
                        "mark yet to show that it lost no events. If events were lost, "
                        "stop statesvc. %s", len(orphans), recovery_steps(self.root.parent))
            return []
        for sha256 in orphans:
            self.remove(sha256)
        return orphans
