"""Adapter weights on the replica: blobs fetched by sha256, verified, cached, parsed."""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import queue
import re
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Protocol

import numpy as np

from computed.residency.direct_write import NewFileWriter
from computed.residency.pool import SlotWeights
from shared.client import ControlClient, RemoteError, Unavailable
from shared.config import MAX_BLOB_CHUNK
from shared.errors import CodedError
from shared.events import AdapterLoaded
from shared.peft import LoraKey, parse_lora_name
from shared.tensorfile import Header, TensorFileError, TensorInfo, parse_header, to_float32
from shared.threadname import name_os_thread


log = logging.getLogger("computed")

PEER_TRIES = 2  # peers asked for a blob before statesvc
# verified blobs waiting for the cache writer at most, in bytes; past it a fetch writes its own
MAX_UNWRITTEN_BYTES = 256 << 20
WRITER_NICE = 10  # the cache writer's niceness above the replica's (Linux: per thread)
SHA256_HEX = re.compile(r"[0-9a-f]{64}")


class BlobError(Exception):
    """A blob that could not be fetched, verified or parsed; the pool is left as it was."""


class Peers(Protocol):
    """Where a replica may fetch a blob besides statesvc (computed/sync.py `PeerList`)."""

    def candidates(self, version: int) -> list[str]:
        """Addresses of other replicas that have applied seq `version`, best first."""
        ...

    def client(self, address: str) -> ControlClient: ...

    def passed_over(self, address: str) -> None:
        """`address` was silent or sent other bytes: leave it out for a while."""
        ...


class BlobCache:
    """Blobs under `root`, by sha256; a cached file whose hash no longer matches is fetched again.

    A blob missing here is fetched from statesvc, or first from a peer replica (`peers`) when
    the caller says which event introduced it (`version`): up to PEER_TRIES of the replicas
    that have applied that event, each a short try; whatever a peer sends is checked against
    the sha256 like statesvc's bytes, and any failure (none has it, silence, other bytes)
    falls back to statesvc. The cached files are served to peers (`has`, `size`,
    `read_chunk`: shared/blobserve.py's ChunkSource); a file appears only once verified
    (written aside, then renamed).

    A fetched blob is written to its file by a thread of its own, at a lower priority, after
    `get` has returned it: the slot write and the applied seq do not wait for the disk (a new
    file of a few MB cost the sync thread 2-70 ms, 8 on average, with 16 replicas writing on
    one box: docs/postgres.md "Fifth look"). Until written, the blob is held in memory
    (`unwritten`), where `get` and peers find it; past MAX_UNWRITTEN_BYTES a fetch writes its
    file itself. `close` writes what is left (a replica stopping); a replica killed first
    fetches those blobs again.

    The files are bounded by `limit_bytes` (--blob-cache-mb; None: unbounded), least
    recently used first out, where a use is a `get` that read the file or its write: each
    write, and each `keep`, removes the least recently used files beyond the bound, except
    the blobs `keep` names (the versions in a slot or the host tier, or being fetched) and
    the one just written. Unloaded adapters' blobs go first of all: nothing uses them again.
    (16 loads of 90 MB each left 1.5 GB here without the bound.)"""

    def __init__(self, root: Path, client: ControlClient, peers: Peers | None = None, *,
                 limit_bytes: int | None = None) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        for leftover in self.root.glob("*.tmp*"):  # a crash while caching a blob
            leftover.unlink(missing_ok=True)
        self.limit_bytes = limit_bytes
        # the cached files, sha256 -> size, least recently used first (at start: by mtime)
        self._files: OrderedDict[str, int] = OrderedDict()
        found = [(p.stat(), p.name) for p in self.root.iterdir()
                 if SHA256_HEX.fullmatch(p.name) and p.is_file()]
        for st, name in sorted(found, key=lambda f: f[0].st_mtime_ns):
            self._files[name] = st.st_size
        self._keep: frozenset[str] = frozenset()  # in use: never removed to fit the bound
        self._files_lock = threading.Lock()
        self.evictions = 0  # files removed to fit the bound
        self.client = client
        self.peers = peers
        self.fetches = 0  # blobs fetched from statesvc (not served from the cache)
        self.peer_fetches = 0  # blobs fetched from a peer replica
        self._lock = threading.Lock()  # the sync thread and the engine's fills both read blobs
        # verified blobs whose files the writer has not written yet (guarded by _unwritten_lock)
        self.unwritten: dict[str, bytes] = {}
        self._unwritten_lock = threading.Lock()
        self._writes: queue.Queue[str | None] = queue.Queue()
        self._writer: threading.Thread | None = None
        self._writer_files = NewFileWriter()

    def path(self, sha256: str) -> Path:
        return self.root / sha256

    def get(self, sha256: str, *, version: int | None = None, size: int | None = None) -> bytes:
        """The blob's bytes; `version`: the seq of the event that introduced it, which makes
        the replicas that have applied it candidates to fetch it from; `size`: its size by
        that event, all a peer may send."""
        with self._lock:
            return self._get(sha256, version, size)

    def _get(self, sha256: str, version: int | None, size: int | None) -> bytes:
        if (held := self._held(sha256)) is not None:
            return held
        cached = self.path(sha256)
        if cached.is_file():
            data = cached.read_bytes()
            if hashlib.sha256(data).hexdigest() == sha256:
                self._used(sha256, len(data))
                return data
            cached.unlink()  # damaged or tampered with: fetch it again
            with self._files_lock:
                self._files.pop(sha256, None)
        peer = self._from_peers(sha256, version, size) \
            if version is not None and size is not None else None
        if peer is None:
            self.fetches += 1
        data = peer if peer is not None else self._fetch(self.client, sha256, "statesvc")
        with self._unwritten_lock:
            later = sum(map(len, self.unwritten.values())) + len(data) <= MAX_UNWRITTEN_BYTES
            if later:
                self.unwritten[sha256] = data
        if later:
            self._start_writer()
            self._writes.put(sha256)
        else:
            self._write(sha256, data)
        return data

    def _write(self, sha256: str, data: bytes) -> None:
        """Write the file aside, flushed and past the page cache (computed/residency/direct_write.py: the cache
        is written once and read rarely), and rename it in."""
        cached = self.path(sha256)
        tmp = cached.with_suffix(f".tmp{os.getpid()}-{threading.get_ident()}")
        self._writer_files.write(tmp, data)
        os.replace(tmp, cached)
        self._used(sha256, len(data))
        self._trim()

    def keep(self, in_use: frozenset[str]) -> None:
        """The blobs in use now (never removed to fit the bound); then trim to the bound."""
        self._keep = in_use
        self._trim()

    def _used(self, sha256: str, size: int) -> None:
        with self._files_lock:
            self._files[sha256] = size
            self._files.move_to_end(sha256)

    def _trim(self) -> None:
        """Remove least recently used files until the rest fit `limit_bytes`, keeping the
        blobs in use and the most recently used one (a write in progress for someone)."""
        if self.limit_bytes is None:
            return
        with self._files_lock:
            total = sum(self._files.values())
            gone = []
            for sha256, size in list(self._files.items())[:-1]:
                if total <= self.limit_bytes:
                    break
                if sha256 in self._keep:
                    continue
                del self._files[sha256]
                total -= size
                gone.append(sha256)
            self.evictions += len(gone)
        for sha256 in gone:
            self.path(sha256).unlink(missing_ok=True)
        if gone:
            log.info("blob cache: removed %d least recently used blob(s) to stay within "
                     "--blob-cache-mb %d", len(gone), self.limit_bytes >> 20)

    def _start_writer(self) -> None:
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_behind, name="blob-writer",
                                            daemon=True)
            self._writer.start()

    def _write_behind(self) -> None:
        name_os_thread()
        try:  # below the sync and serving threads: it runs when they wait
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(),
                           min(19, os.getpriority(os.PRIO_PROCESS, 0) + WRITER_NICE))
        except (AttributeError, OSError):  # not Linux, where a thread has no priority of its own
            pass
        while (sha256 := self._writes.get()) is not None:
            data = self._held(sha256)
            try:
                if data is not None:
                    self._write(sha256, data)
            except OSError as exc:  # a full disk: the blob is fetched again when next needed
                log.warning("blob %s not written to the cache (%s)", sha256[:12], exc)
            finally:
                with self._unwritten_lock:
                    self.unwritten.pop(sha256, None)

    def close(self) -> None:
        """Write the blobs still held in memory to their files, and stop the writer."""
        if self._writer is not None:
            self._writes.put(None)
            self._writer.join()
            self._writer = None

    def _from_peers(self, sha256: str, version: int, size: int) -> bytes | None:
        if self.peers is None:
            return None
        try:
            candidates = self.peers.candidates(version)[:PEER_TRIES]
        except (RemoteError, Unavailable) as exc:  # statesvc's status: its fetch says more
            log.debug("no peer list (%s); fetching %s from statesvc", exc, sha256[:12])
            return None
        for address in candidates:
            peer = self.peers.client(address)
            try:
                data = self._fetch(peer, sha256, f"replica {address}", size=size)
            except (RemoteError, Unavailable, BlobError) as exc:
                if not isinstance(exc, RemoteError):  # silence, other bytes; not_found is fine
                    self.peers.passed_over(address)
                log.info("blob %s not fetched from peer %s (%s); trying the next",
                         sha256[:12], address, exc)
                continue
            finally:
                peer.close()
            self.peer_fetches += 1
            return data
        return None

    @staticmethod
    def _fetch(client: ControlClient, sha256: str, source: str, *,
               size: int | None = None) -> bytes:
        """The blob from `source` chunk by chunk; with `size`, a source that says or sends
        another size is refused (BlobError), as is any reply not shaped like `blob`'s."""
        parts: list[bytes] = []
        offset, total = 0, None
        while total is None or offset < total:
            chunk = client.call("blob", {"sha256": sha256, "offset": offset,
                                         "length": MAX_BLOB_CHUNK})
            said, data = (chunk.get("size"), chunk.get("data")) if isinstance(chunk, dict) \
                else (None, None)
            if type(said) is not int or not isinstance(data, bytes) or len(data) > MAX_BLOB_CHUNK \
                    or offset + len(data) > said or (size is not None and said != size):
                raise BlobError(f"blob {sha256[:12]} from {source}: a reply that is not the "
                                f"blob's next chunk (size {said!r}"
                                f"{'' if size is None else f', the event says {size}'}); "
                                "not applied")
            total = said
            if not data and offset < total:
                raise BlobError(f"blob {sha256[:12]} ended at {offset} of {total} bytes")
            parts.append(data)
            offset += len(data)
        blob = b"".join(parts)
        got = hashlib.sha256(blob).hexdigest()
        if got != sha256:
            raise BlobError(f"blob {sha256[:12]} from {source} hashes to {got[:12]}; not "
                            "applied, will fetch it again")
        return blob

    # ---- served to peers (shared/blobserve.py's ChunkSource) ---------------------------

    def has(self, sha256: str) -> bool:
        return SHA256_HEX.fullmatch(sha256) is not None and (
            self._held(sha256) is not None or self.path(sha256).is_file())

    def size(self, sha256: str) -> int:
        if (held := self._held(sha256)) is not None:
            return len(held)
        try:
            return self.path(sha256).stat().st_size
        except FileNotFoundError:
            raise _gone(sha256) from None

    def _held(self, sha256: str) -> bytes | None:
        with self._unwritten_lock:
            return self.unwritten.get(sha256)

    def read_chunk(self, sha256: str, offset: int, length: int) -> bytes:
        if (held := self._held(sha256)) is not None:
            return held[offset:offset + min(length, MAX_BLOB_CHUNK)]
        try:
            with self.path(sha256).open("rb") as f:
                f.seek(offset)
                return f.read(min(length, MAX_BLOB_CHUNK))
        except FileNotFoundError:
            raise _gone(sha256) from None


def _gone(sha256: str) -> CodedError:
    """A cached blob removed while a peer read it (found damaged and fetched again): the peer
    is told `not_found`, as for one never held, and asks the next."""
    return CodedError("not_found", f"no blob {sha256} (removed from this replica's cache)",
                      "args.sha256")


# a header up to this size is parsed once per distinct header (its bytes are the cache key)
CACHED_HEADER_BYTES = 1 << 20
_Layout = tuple[Header, tuple[tuple[LoraKey | None, TensorInfo], ...]]


def _parse_layout(head: bytes, size: int) -> _Layout:
    """The header `head` (the length and the JSON) of a `size`-byte safetensors file, parsed
    and checked, each tensor with its LoRA key (None: not a LoRA weight)."""
    header = parse_header(head, size)
    return header, tuple((parse_lora_name(name), info) for name, info in header.tensors.items())


# adapters of one shape have identical headers (names, shapes, offsets): each distinct one is
# parsed and checked once, not at every load (the result depends on nothing else)
_cached_layout = functools.lru_cache(maxsize=16)(_parse_layout)


def _layout(data: bytes) -> _Layout:
    n = int.from_bytes(data[:8], "little")
    if len(data) < 8 or 8 + n > len(data) or n > CACHED_HEADER_BYTES:
        return _parse_layout(data, len(data))  # refused, or too big to keep
    return _cached_layout(bytes(data[:8 + n]), len(data))


def slot_weights(data: bytes, adapter: AdapterLoaded) -> SlotWeights:
    """Parse an adapter's safetensors bytes into the pool's (layer, module) -> (A, B) pairs."""
    what = f"adapter {adapter.name} v{adapter.version}"
    try:
        header, keys = _layout(data)
    except TensorFileError as exc:
        raise BlobError(f"{what}: {exc}") from None
    halves: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, info in keys:
        if key is None:
            raise BlobError(f"{what}: unexpected tensor {info.name!r}")
        try:
            # F32 tensors stay views of the (immutable) blob: the slot write copies them once
            halves.setdefault((key.layer, key.module), {})[key.matrix] = to_float32(
                data, header, info, copy=False)
        except TensorFileError as exc:
            raise BlobError(f"{what}: {exc}") from None
    pairs = {}
    for where, ab in halves.items():
        if set(ab) != {"A", "B"}:
            raise BlobError(f"{what}: layer {where[0]} {where[1]} lacks lora_A or lora_B")
        pairs[where] = (ab["A"], ab["B"])
    return SlotWeights(scaling=adapter.scaling, rank=adapter.rank, pairs=pairs)
