"""A replica's sync logic: the log's state and the JAX pool, kept in step with statesvc.

After the ZeroMQ Guide's Clone pattern (the daemon subscribes before it calls
`bootstrap`). Events are applied strictly in seq order; older ones are dropped
and a gap is filled by fetching the missing range. Every advance reduces the
events' metadata first (the pure reducer from shared/), then reconciles the
pool with the new state: only slots whose adapter changed are written or
cleared, so replaying any log reads weights only for adapters live at the
head. Weights are fetched and parsed before anything changes: a blob that
cannot be fetched or parsed leaves the state and the pool as they were, and the
advance is retried.

Every answer statesvc gives names its log (docs/protocol.md §9b). A replica holds one
log from its first applied event on (kept with its local state): it refuses another
log's events, state and pool untouched, and stays REFUSED until its own log answers.
"""
from __future__ import annotations

import enum
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import msgpack

from computed.residency.blob_cache import BlobCache, BlobError, Peers, slot_weights
from computed.residency.host_tier import FetchFailed, HostTier
from computed.residency.manager import ResidencyManager
from computed.residency.pool import LoraPool, MemoryPool, PoolSpec
from computed.residency.slots import ResidentVersion, SlotMap
from computed.serving.admission import AdmittedAdapter, GenerateError, NoSlot, NotReady
from shared.canonical import canonical_bytes
from shared.client import ControlClient
from shared.config import DEFAULT_BLOB_CACHE_MB, DEFAULT_HOST_CACHE_MB
from shared.events import AdapterLoaded, Body, EventError, PoolConfigured, decode_body
from shared.faults import NO_FAULTS, Faults
from shared.fingerprint import ModelInfo
from shared.prefix import content_root
from shared.reducer import (State, apply, from_canonical, logical_digest, snapshot_bytes,
                            verified_snapshot)

log = logging.getLogger("computed")
NO_POOL = "none"
PENDING = "pending"
SAVE_EVERY_S = 0.5  # the local state is saved at most this often, and when the daemon stops


class Phase(enum.Enum):
    INITIAL = "INITIAL"    # nothing applied yet
    SYNCING = "SYNCING"    # fetching the snapshot and the events after it
    ACTIVE = "ACTIVE"      # following the diff stream
    REFUSED = "REFUSED"    # statesvc answers for another log: nothing of it is applied


class ModelMismatch(Exception):
    """The replica's model is not the one the pool was configured for: it must not serve."""


class ForeignLog(Exception):
    """statesvc answers for another log than the one this replica's state comes from."""


class Replica:
    def __init__(self, model: ModelInfo, client: ControlClient, cache_dir: Path, *,
                 from_zero: bool = False, faults: Faults = NO_FAULTS,
                 host_cache_mb: int = DEFAULT_HOST_CACHE_MB,
                 blob_cache_mb: int | None = DEFAULT_BLOB_CACHE_MB, prefetch: bool = False,
                 pool_layout: Callable[[PoolSpec], LoraPool] | None = None,
                 peers: Peers | None = None, weights_sha256: str | None = None) -> None:
        self.model = model
        # the digest of the weights this replica serves (shared/fingerprint.py); None where it
        # serves none (`--no-inference`), which checks the fingerprint alone
        self.weights_sha256 = weights_sha256
        self.from_zero = from_zero  # replay the whole log: no snapshot, no local state
        self.faults = faults  # test-only (shared/faults.py): off unless switched on
        self.syncing_seq = 0  # how far a catch-up has read the log
        self.client = client
        self.cache_dir = Path(cache_dir)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        # the device slots, the host tier and the blob cache: the one way into the pool
        blobs = BlobCache(self.cache_dir / "blobs", client, peers,
                          limit_bytes=None if blob_cache_mb is None else blob_cache_mb << 20)
        self.tiers = ResidencyManager(blobs,
                                      host_cache_mb << 20, faults=faults,
                                      pool_layout=pool_layout)
        self.prefetch = prefetch  # parse newly loaded adapters into the host tier
        self.state = State()
        self.log_id: str | None = None  # the log the state comes from; None until one is held
        self.phase = Phase.INITIAL
        self.last_error: str | None = None
        self.applied_at = 0.0  # wall-clock time of the last advance
        # held while the state and the pool's slots change together, and by readers
        # that resolve an adapter to its slot and lease it
        self.lock = threading.Lock()
        self._digests: dict[str, tuple[tuple[int, int], str]] = {}
        self._unsaved, self._saved_at = False, -SAVE_EVERY_S  # the local state's last save

    # ---- the tiers (computed/residency/manager.py) --------------------------------

    @property
    def pool(self) -> MemoryPool | None:
        """The device tier's memory pool; None until the pool is configured."""
        return self.tiers.pool

    @property
    def residency(self) -> SlotMap | None:
        """Which slot holds which adapter version; None until the pool is configured."""
        return self.tiers.slots

    @property
    def fills(self) -> HostTier:
        """The host tier and the worker that fetches and parses into it."""
        return self.tiers.host

    @property
    def blobs(self) -> BlobCache:
        return self.tiers.blobs

    # ---- status ----------------------------------------------------------------

    @property
    def applied_seq(self) -> int:
        return self.state.seq

    def logical_digest(self) -> str:
        return self._cached("logical", lambda: logical_digest(self.state))

    @property
    def holders(self) -> dict[int, ResidentVersion]:
        """What each slot holds now."""
        return {} if self.residency is None else dict(self.residency.holders)

    def resident(self) -> dict[int, tuple[ResidentVersion, str]]:
        """Each occupied slot's holder and content digest (pool.py's `slot_digest`). Without
        the replica's lock: status answers while a slot write or a fill holds it."""
        pool, holders = self.pool, self.holders
        if pool is None:
            return {}
        return {s: (h, pool.slot_digest(s)) for s, h in sorted(holders.items())}

    def host_tier(self) -> list[tuple[str, int, str]]:
        """(name, version, sha256) of each adapter version in the host tier, least recently used
        first: parsed and ready for a slot write without a fetch. Only registered versions
        (one that just left the registry is dropped from the tier on the next advance)."""
        adapters = self.state.adapters
        return [(n, v, a.sha256) for n, v in self.fills.host_keys()
                if (a := adapters.get(n)) is not None and a.version == v]

    def pool_digest(self) -> str:
        """The digest of the resident set: sha256 over its (name, version, content digest)
        triples in name order, wherever the slots are; 'pending' while a write waits for a
        slot's readers. Two replicas that hold the same versions have the same one."""
        if self.pool is None:
            return NO_POOL
        if self.pool.pending:
            return PENDING
        assert self.residency is not None
        return self._cached("pool", lambda: hashlib.sha256(canonical_bytes(sorted(
            [h.name, h.version, d] for h, d in self.resident().values()))).hexdigest(),
            key=self.residency.generation)

    def _cached(self, what: str, compute: Any, *, key: int = 0) -> str:
        hit = self._digests.get(what)
        if hit is None or hit[0] != (self.state.seq, key):
            hit = ((self.state.seq, key), compute())
            self._digests[what] = hit
        return hit[1]

    # ---- the admission port (computed/serving/admission.py) ------------------------------

    def admit(self, adapter: str | None, min_seq: int, ticket: int = 0) -> AdmittedAdapter:
        """Resolve `adapter` to its registered version, make it resident if it is not (a miss:
        its weights from the host tier, fetched and parsed there by the fill worker, then a
        slot write on the caller's thread) and lease its slot. Raises Fetching while the
        worker fetches them, NoSlot while no slot can be had (the request waits; `ticket`,
        smaller for older requests, decides who reserves the next slot:
        computed/residency/slots.py), FetchFailed when they could not be fetched."""
        ready = self.phase is Phase.ACTIVE and self.pool is not None
        if not ready or self.applied_seq < min_seq:
            raise NotReady(f"the replica is {self.phase.value} at seq {self.applied_seq} and "
                           f"did not reach min_seq {min_seq}", "args.min_seq" if ready else None)
        with self.lock:  # the state and the slots it names change together
            state, pool, res = self.state, self.pool, self.residency
            assert pool is not None and res is not None
            if adapter is None:
                return AdmittedAdapter(-1, None, 0, state.seq, None)
            loaded = state.adapters.get(adapter)
            if loaded is None:
                res.forget(ticket)
                raise GenerateError("unknown_adapter", f"adapter {adapter!r} is not loaded on "
                                    f"this replica (at seq {state.seq}); `loractl list` shows "
                                    "what is", "args.adapter")
            slot = res.slot_of(loaded.name, loaded.version)
            if slot is not None and res.blocked(slot, ticket):
                raise NoSlot(f"slot {slot} is reserved for an older request")
            if slot is None:
                try:  # NoSlot, Fetching: it waits, holding no slot
                    slot = self.tiers.make_resident(loaded, ticket=ticket)
                except FetchFailed as exc:
                    self.last_error = f"filling {loaded.name} v{loaded.version}: {exc}"
                    raise
                assert slot is not None
                lease = pool.acquire(slot)  # SlotDraining: admit once it is rewritten
            else:
                lease = pool.acquire(slot)
                res.lease(slot, ticket)
            return AdmittedAdapter(slot, loaded.name, loaded.version, state.seq, lease,
                                   content_root(loaded.sha256, loaded.scaling))

    def want(self, adapter: str | None) -> None:
        """A request for `adapter` was queued: unless a slot holds its registered version,
        start fetching and parsing it now, beside the decode steps."""
        loaded = None if adapter is None else self.state.adapters.get(adapter)
        if loaded is not None:
            self.tiers.want(loaded)

    def withdraw(self, ticket: int) -> None:
        with self.lock:
            if self.residency is not None:
                self.residency.forget(ticket)

    def reading(self) -> AbstractContextManager[LoraPool]:
        assert self.pool is not None
        return self.pool.reading()

    def pool_shapes(self) -> LoraPool | None:
        return None if self.pool is None else self.pool.shapes()

    # ---- sync ------------------------------------------------------------------

    def bootstrap(self) -> None:
        """Reach the head from the local state (warm cache), statesvc's latest snapshot, or,
        with `from_zero`, from an empty state and every event of the log."""
        if self.phase is not Phase.REFUSED:  # a refused replica stays so until this succeeds
            self.phase = Phase.SYNCING
        base = None if self.from_zero else self._local_state()
        log_id = self.log_id
        if base is None and self.from_zero:
            base = State()
        elif base is None:
            snap = self.client.call("snapshot")
            self.check_log(snap.get("log_id"))
            log_id = snap.get("log_id")
            try:
                base = verified_snapshot(snap["seq"], snap["state"], snap["digest"])
            except EventError as exc:
                raise BlobError(str(exc)) from None
        try:
            self.catch_up(base, log_id=log_id)
        except BlobError:
            if base.seq > self.state.seq:  # serve what can be served while the rest is retried
                try:
                    self._advance_to(base, log_id)
                except BlobError:
                    pass
            raise
        self.phase = Phase.ACTIVE

    def check_log(self, remote: str | None) -> None:
        """Refuse an answer of statesvc's that is for another log than the one this replica
        holds (a statesvc restarted with another data dir on the same address): REFUSED."""
        if self.log_id is None or remote == self.log_id:
            return
        self.phase = Phase.REFUSED
        theirs = f"log {remote}" if remote else "a log with no events yet"
        raise ForeignLog(f"statesvc at {self.client.address} serves {theirs}, but this "
                         f"replica's state comes from log {self.log_id}: nothing of it is "
                         "applied. Restart this replica with an empty --cache-dir to follow "
                         f"the new log, or point --state and --diffs at the statesvc of log "
                         f"{self.log_id}")

    def catch_up(self, base: State | None = None, *, log_id: str | None = None) -> int:
        """Fetch every event after `base` (default: the applied state), reduce their metadata
        up to the head, then reconcile the pool once; returns how many events were read.
        `log_id` is the log `base` comes from (default: the one the replica holds)."""
        state = self.state if base is None else base
        log_id = log_id or self.log_id
        read = 0
        while True:
            reply = self.client.call("events", {"since": state.seq})
            self.check_log(reply.get("log_id"))
            if log_id is not None and reply.get("log_id") != log_id:  # changed under a catch-up
                raise ForeignLog(f"statesvc's log changed from {log_id} to "
                                 f"{reply.get('log_id')} during a catch-up; retrying")
            log_id = reply.get("log_id")
            page = reply["events"]
            if not page:
                break
            for ev in page:
                state = apply(state, ev["seq"], decode_body(ev["type"], ev["payload"]))
            read += len(page)
            self.syncing_seq = state.seq
        if state is not self.state:
            self._advance_to(state, log_id)
        return read

    def apply_events(self, events: list[tuple[int, Body]], *, log_id: str | None) -> None:
        """Apply consecutive events of log `log_id` from applied+1 on (older ones are
        dropped)."""
        self.check_log(log_id)
        events = [e for e in events if e[0] > self.state.seq]
        if not events:
            return
        if events[0][0] != self.state.seq + 1:
            raise GapError(self.state.seq + 1, events[0][0])
        state = self.state
        for seq, body in events:
            state = apply(state, seq, body)
        self._advance_to(state, log_id)

    def _advance_to(self, new: State, log_id: str | None) -> None:
        """Take the registry `new`: versions that left it stop routing at once and their slots
        are cleared when their leases end; pinned adapters are made resident, and the newest
        unpinned ones fill the slots left free (the rest wait for a request: a miss)."""
        if new.pool is not None:
            self._check_model(new.pool)
        pool, res = self.pool, self.residency
        if pool is None and new.pool is not None:
            pool, res = self.tiers.configure(new.pool)
        fills = [] if res is None else self.tiers.wanted(new, res)
        # the live tail (the one event just recorded) comes from statesvc: no peer has it
        # yet; a bootstrap or catch-up asks the replicas that applied each event first
        live = new.seq == self.state.seq + 1
        weights = {a.name: slot_weights(self.blobs.get(
            a.sha256, version=None if live and a.version == new.seq else a.version,
            size=a.size), a) for a, _ in fills}
        # nothing has changed up to here; from here on nothing can fail
        with self.lock:
            if pool is not None and res is not None:
                self.tiers.reconcile(new, pool, res, fills, weights)
            self.tiers.adopt(pool, res)
            old, self.state, self.log_id = self.state, new, log_id
        self.tiers.retain(new)  # versions that left the registry leave the host tier
        if self.prefetch and self.phase is Phase.ACTIVE:
            for a in new.adapters.values():
                if (was := old.adapters.get(a.name)) is None or was.version != a.version:
                    self.fills.want(a, demand=False)
        self.applied_at = time.time()
        self.last_error = None
        self._unsaved = True
        self.save_local_state(every_s=SAVE_EVERY_S)

    def _check_model(self, pool: PoolConfigured) -> None:
        if pool.fingerprint == self.model.fingerprint:
            ours, theirs = self.weights_sha256, pool.weights_sha256
            if ours is None or theirs is None or ours == theirs:
                return
            raise ModelMismatch(
                f"this replica's model has the pool's config.json and tensor shapes but other "
                f"weights (sha256 {ours[:12]}, the pool's base model {theirs[:12]}): another "
                "checkpoint of the same architecture, such as a fine-tune; start computed with "
                "--model pointing at the pool's base model")
        diffs = sorted(k for k in set(pool.model_config) | set(self.model.config)
                       if pool.model_config.get(k) != self.model.config.get(k))
        detail = (f"config.json differs in {', '.join(diffs)}" if diffs
                  else "config.json is the same but the tensors' names, shapes or dtypes differ")
        raise ModelMismatch(f"this replica's model has fingerprint {self.model.fingerprint[:12]}, "
                            f"but the pool was configured for {pool.fingerprint[:12]} ({detail}); "
                            "start computed with --model pointing at the pool's base model")

    # ---- the warm cache -----------------------------------------------------------

    def _local_state(self) -> State | None:
        """The state saved in the cache dir when statesvc's log still holds it; its log
        becomes the one this replica holds."""
        path = self.cache_dir / "state.msgpack"
        try:
            saved = msgpack.unpackb(path.read_bytes())
            state = from_canonical(saved["seq"], saved["state"])
            saved_log = saved.get("log_id")  # absent in a cache from before log ids
            if saved_log is not None and not isinstance(saved_log, str):
                raise ValueError(f"log_id {saved_log!r}")
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if state.seq == 0:
            return None
        self.log_id = saved_log or self.log_id
        head = self.client.call("events", {"since": state.seq, "limit": 1})
        self.check_log(head.get("log_id"))
        # the log this cache followed must be the log statesvc has now
        if head["head_seq"] < state.seq:
            log.warning("discarding the local state at seq %d: statesvc's log ends at seq %d",
                        state.seq, head["head_seq"])
            return None
        remote = self.client.call("digest", {"seq": state.seq})["digest"]
        if remote != logical_digest(state):
            log.warning("discarding the local state at seq %d: statesvc's digest differs",
                        state.seq)
            return None
        self.log_id = head.get("log_id")  # a cache from before log ids takes statesvc's
        return state

    def save_local_state(self, *, every_s: float = 0.0) -> None:
        """Save the applied state unless it is saved, or was saved less than `every_s` ago (a
        burst of events is saved once; the sync loop saves the rest on its next turns)."""
        if self._unsaved and time.monotonic() - self._saved_at >= every_s:
            self._save_local_state()
            self._unsaved, self._saved_at = False, time.monotonic()

    def _save_local_state(self) -> None:
        """{"log_id", "seq", "state"} as canonical msgpack, the state from its bodies' cached
        bytes (shared/reducer.py's `snapshot_bytes`): a large registry is not packed again."""
        path = self.cache_dir / "state.msgpack"
        tmp = path.with_suffix(".tmp")
        packer = msgpack.Packer(use_bin_type=True)
        tmp.write_bytes(b"".join([packer.pack_map_header(3), packer.pack("log_id"),
                                  packer.pack(self.log_id), packer.pack("seq"),
                                  packer.pack(self.state.seq), packer.pack("state"),
                                  snapshot_bytes(self.state)]))
        os.replace(tmp, path)


class GapError(Exception):
    def __init__(self, expected: int, got: int) -> None:
        super().__init__(f"expected seq {expected}, got {got}")
        self.expected = expected
        self.got = got


__all__ = ["AdapterLoaded", "BlobError", "ForeignLog", "GapError", "ModelMismatch", "Phase",
           "Replica"]
