"""The host tier, and filling it without stalling decode: a worker fetches, verifies, parses.

The host tier holds parsed adapter weights ready for a slot write, LRU within a byte bound.
Between the device slots (computed/residency/slots.py) and the verified on-disk blob cache
(computed/residency/blob_cache.py): an entry is one registered adapter version's parsed A and
B arrays (computed/residency/pool.py's SlotWeights, unpadded: the slot write pads them to
max_rank), so filling a slot from it costs the slot write alone. The bookkeeping is
shared/lru.py's `ByteLRU` (the rules are there), sized by `weights_bytes`; the fill worker
holds its lock around every call.

A request whose adapter is not resident asks for its weights as soon as it is queued
(`want`); one worker thread reads the blob (the verified on-disk cache, else statesvc, then
sha256), parses it and puts the parsed arrays into the host tier. The residency manager
(manager.py `make_resident`, for a request's miss) calls `take`: an entry in the host tier
comes back for the donated slot write, the only part of a fill on the step's path; otherwise `Fetching`
(the request keeps waiting, requests whose adapters are resident go ahead) or, when the
fetch failed, `FetchFailed` with the reason (the engine retries until --min-seq-timeout, then
answers `not_ready` with it; a failed fetch is tried again after RETRY_S).

`retain` (each applied advance) drops the host-tier entries, queued fetches and failures of
versions that left the registry: an unloaded or replaced version is never filled from here
again, and a fetch in flight for it is discarded when it ends. Nothing here grows with the
registry: the host tier is bounded in bytes, the queue by the requests waiting for a fill.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from computed.serving.admission import Fetching, NotReady
from computed.residency.pool import SlotWeights
from computed.residency.blob_cache import BlobCache, BlobError, slot_weights
from shared.client import RemoteError, Unavailable
from shared.events import AdapterLoaded
from shared.lru import ByteLRU
from shared.threadname import name_os_thread

log = logging.getLogger("computed")
RETRY_S = 1.0
SAMPLES = 1024  # fill times kept per tier for the percentiles
Key = tuple[str, int]  # (adapter name, version)
HostLRU = ByteLRU


def weights_bytes(w: SlotWeights) -> int:
    """The host bytes of an adapter's parsed arrays."""
    return sum(int(np.asarray(a).nbytes) + int(np.asarray(b).nbytes) for a, b in w.pairs.values())


class FetchFailed(NotReady):
    """The adapter's weights could not be had (statesvc down, a bad blob): retried later."""


@dataclass(frozen=True)
class HostWeights:
    """An adapter's parsed weights taken from the host tier for a slot write."""

    weights: SlotWeights
    fetch_s: float | None  # the fetch this request waited for (a host-tier miss); None: a hit


def key_of(adapter: AdapterLoaded) -> Key:
    return (adapter.name, adapter.version)


class HostTier:
    """The host tier and its fill worker (see the module docstring)."""

    def __init__(self, blobs: BlobCache, host_bytes: int) -> None:
        self.blobs = blobs
        self.host: HostLRU[Key, SlotWeights] = HostLRU(host_bytes, weights_bytes)
        mutex = threading.RLock()
        self._lock = threading.Condition(mutex)  # the worker waits on it for the queue
        self._ended = threading.Condition(mutex)  # requests wait on it for a fetch's end
        self._queue: deque[AdapterLoaded] = deque()
        self._pending: dict[Key, bool] = {}  # queued or in flight -> asked for by a request
        self._failed: dict[Key, tuple[str, float]] = {}
        self._fresh: dict[Key, float] = {}  # fetched for a request, not yet written: fetch_s
        # fetched for a request but larger than the whole host tier: handed over once
        self._handoff: dict[Key, SlotWeights] = {}
        self.fetching: Key | None = None
        self.fetch_errors = 0
        self.hits = self.misses = 0  # slot fills from an entry already there / fetched for it
        self.times: dict[str, deque[float]] = {"host": deque(maxlen=SAMPLES),
                                                "miss": deque(maxlen=SAMPLES)}
        self._worker: threading.Thread | None = None

    # ---- asking ------------------------------------------------------------------

    def want(self, adapter: AdapterLoaded, *, demand: bool = True) -> None:
        """Start fetching `adapter` into the host tier unless it is there, queued, or failed
        less than RETRY_S ago. `demand`: a request waits for it (else a prefetch)."""
        key = key_of(adapter)
        with self._lock:
            if key in self.host or key in self._pending or key in self._handoff:
                if demand and key in self._pending:
                    self._pending[key] = True
                return
            failed = self._failed.get(key)
            if failed is not None and time.monotonic() - failed[1] < RETRY_S:
                return
            self._failed.pop(key, None)
            self._pending[key] = demand
            self._queue.append(adapter)
            self._lock.notify()
            if self._worker is None:
                self._worker = threading.Thread(target=self._run, name="fills", daemon=True)
                self._worker.start()

    def take(self, adapter: AdapterLoaded) -> HostWeights:
        """The parsed weights of `adapter` for a slot write; raises Fetching (wait) or
        FetchFailed (the reason; a retry starts after RETRY_S)."""
        key = key_of(adapter)
        with self._lock:
            entry = self.host.get(key)
            handoff = self._handoff.pop(key, None)
            if entry is not None or handoff is not None:
                weights = entry.value if entry is not None else handoff
                assert weights is not None
                took = HostWeights(weights, self._fresh.pop(key, None))
                if took.fetch_s is None:
                    self.hits += 1
                else:
                    self.misses += 1
                return took
            failed = self._failed.get(key)
        if failed is not None and time.monotonic() - failed[1] < RETRY_S:
            raise FetchFailed(f"the weights of adapter {adapter.name!r} v{adapter.version} "
                              f"could not be fetched ({failed[0]}); retrying")
        self.want(adapter)
        raise Fetching(f"fetching the weights of adapter {adapter.name!r} v{adapter.version}",
                       lambda timeout_s: self.await_fetch(key, timeout_s))

    def await_fetch(self, key: Key, timeout_s: float) -> bool:
        """Block until the fetch of `key` ends (fetched, failed or dropped): True, or until
        `timeout_s` passes: False."""
        with self._lock:
            return self._ended.wait_for(lambda: key not in self._pending, timeout_s)

    def wrote(self, took: HostWeights, write_s: float) -> None:
        """A slot write from `took` took `write_s`: one fill time sample of its tier."""
        if took.fetch_s is None:
            self.times["host"].append(write_s)
        else:
            self.times["miss"].append(took.fetch_s + write_s)

    def versions(self) -> set[Key]:
        """The versions held here, or being fetched or handed over: their blobs are in use."""
        with self._lock:
            return {*self.host.keys(), *self._pending, *self._handoff, *self._fresh}

    def retain(self, current: Callable[[str, int], bool]) -> None:
        """Forget every version `current` refuses (it left the registry)."""
        def keep(k: Key) -> bool:
            return current(*k)
        with self._lock:
            self.host.retain(keep)
            for d in (self._pending, self._failed, self._fresh, self._handoff):
                for k in [k for k in d if not keep(k)]:
                    del d[k]
            self._queue = deque(a for a in self._queue if keep(key_of(a)))
            self._ended.notify_all()

    # ---- the worker ----------------------------------------------------------------

    def _run(self) -> None:
        name_os_thread()
        while True:
            with self._lock:
                while not self._queue:
                    self._lock.wait()
                adapter = self._queue.popleft()
                key = key_of(adapter)
                if key not in self._pending:
                    continue  # dropped meanwhile
                self.fetching = key
            t0 = time.perf_counter()
            try:
                weights: SlotWeights | None = slot_weights(self.blobs.get(adapter.sha256), adapter)
                error = ""
            except (BlobError, OSError, Unavailable, RemoteError) as exc:
                weights, error = None, str(exc)
            except Exception as exc:  # a bug: the waiting requests get it, the worker lives on
                log.exception("fill worker: %s v%d", adapter.name, adapter.version)
                weights, error = None, f"{type(exc).__name__}: {exc}"
            fetch_s = time.perf_counter() - t0
            with self._lock:
                self.fetching = None
                demand = self._pending.pop(key, None)
                self._ended.notify_all()
                if demand is None:
                    continue  # unloaded or replaced while it was fetched: discarded
                if weights is None:
                    self.fetch_errors += 1
                    self._failed[key] = (error, time.monotonic())
                    log.warning("fetching %s v%d: %s", adapter.name, adapter.version, error)
                    continue
                if not self.host.put(key, weights) and demand:
                    self._handoff[key] = weights
                if demand:
                    self._fresh[key] = fetch_s
                for d in (self._fresh, self._handoff):  # fetched for requests that left
                    while len(d) > SAMPLES:
                        del d[next(iter(d))]

    # ---- status ------------------------------------------------------------------

    def host_keys(self) -> list[Key]:
        """The (name, version) of every entry in the host tier, least recently used first."""
        with self._lock:
            return self.host.keys()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            h = self.host
            return {"host_entries": len(h), "host_bytes": h.bytes, "host_limit_bytes": h.limit,
                    "host_hits": self.hits, "host_misses": self.misses,
                    "host_evictions": h.evictions, "fetching": len(self._pending),
                    "fetch_errors": self.fetch_errors,
                    "fill_ms": {tier: percentiles(list(t)) for tier, t in self.times.items()}}


def percentiles(samples: list[float]) -> dict[str, Any]:
    """{n, p50, p99} in ms of samples in seconds (None without samples)."""
    if not samples:
        return {"n": 0, "p50": None, "p99": None}
    a = np.asarray(samples) * 1e3
    return {"n": len(samples), "p50": float(np.percentile(a, 50)),
            "p99": float(np.percentile(a, 99))}


__all__ = ["FetchFailed", "HostLRU", "HostTier", "HostWeights", "key_of", "percentiles", "weights_bytes"]
