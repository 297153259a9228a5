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
import logging
import os
import threading
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from computed.admission import GenerateError, Grant, NotReady
from computed.pool import LoraPool, MemoryPool, PoolSpec, SlotWeights
from computed.weights import BlobCache, BlobError, slot_weights
from shared.canonical import canonical_bytes
from shared.client import ControlClient
from shared.events import AdapterLoaded, Body, PoolConfigured, decode_body
from shared.faults import NO_FAULTS, Faults
from shared.fingerprint import ModelInfo
from shared.reducer import State, apply, canonical, from_canonical, logical_digest

log = logging.getLogger("computed")
NO_POOL = "none"
PENDING = "pending"


class Phase(enum.Enum):
    INITIAL = "INITIAL"    # nothing applied yet
    SYNCING = "SYNCING"    # fetching the snapshot and the events after it
    ACTIVE = "ACTIVE"      # following the diff stream
    REFUSED = "REFUSED"    # statesvc answers for another log: nothing of it is applied


class ModelMismatch(Exception):
    """The replica's model is not the one the pool was configured for: it must not serve."""


class ForeignLog(Exception):
    """statesvc answers for another log than the one this replica's state comes from."""


@dataclass(frozen=True)
class SlotHolder:
    name: str
    version: int
    sha256: str


def pool_spec(pool: PoolConfigured) -> PoolSpec:
    return PoolSpec(num_layers=pool.num_layers,
                    module_dims={m: pool.module_dims[m] for m in pool.targets},
                    slots=pool.max_loras, max_rank=pool.max_rank, dtype=pool.dtype)


class Replica:
    def __init__(self, model: ModelInfo, client: ControlClient, cache_dir: Path, *,
                 from_zero: bool = False, faults: Faults = NO_FAULTS) -> None:
        self.model = model
        self.from_zero = from_zero  # replay the whole log: no snapshot, no local state
        self.faults = faults  # test-only (shared/faults.py): off unless switched on
        self.syncing_seq = 0  # how far a catch-up has read the log
        self.client = client
        self.cache_dir = Path(cache_dir)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self.blobs = BlobCache(self.cache_dir / "blobs", client)
        self.state = State()
        self.log_id: str | None = None  # the log the state comes from; None until one is held
        self.phase = Phase.INITIAL
        self.pool: MemoryPool | None = None
        self.holders: dict[int, SlotHolder] = {}  # what each pool slot holds now
        self.last_error: str | None = None
        self.applied_at = 0.0  # wall-clock time of the last advance
        # held while the state and the pool's slots change together, and by readers
        # that resolve an adapter to its slot and lease it
        self.lock = threading.Lock()
        self._digests: dict[str, tuple[int, str]] = {}

    # ---- status ----------------------------------------------------------------

    @property
    def applied_seq(self) -> int:
        return self.state.seq

    def logical_digest(self) -> str:
        return self._cached("logical", lambda: logical_digest(self.state))

    def pool_digest(self) -> str:
        """The pool's digest, or 'pending' while a write waits for a slot's readers."""
        if self.pool is not None and self.pool.pending:
            return PENDING
        return self._cached("pool", lambda: self.pool.digest() if self.pool else NO_POOL)

    def _cached(self, what: str, compute: Any) -> str:
        hit = self._digests.get(what)
        if hit is None or hit[0] != self.state.seq:
            hit = (self.state.seq, compute())
            self._digests[what] = hit
        return hit[1]

    # ---- the admission port (computed/admission.py) ------------------------------

    def admit(self, adapter: str | None, min_seq: int) -> Grant:
        """Resolve `adapter` to the slot and version held now and lease the slot."""
        ready = self.phase is Phase.ACTIVE and self.pool is not None
        if not ready or self.applied_seq < min_seq:
            raise NotReady(f"the replica is {self.phase.value} at seq {self.applied_seq} and "
                           f"did not reach min_seq {min_seq}", "args.min_seq" if ready else None)
        with self.lock:  # the state and the slots it names change together
            state, pool = self.state, self.pool
            assert pool is not None
            if adapter is None:
                return Grant(-1, None, 0, state.seq, None)
            loaded = state.adapters.get(adapter)
            if loaded is None:
                raise GenerateError("unknown_adapter", f"adapter {adapter!r} is not loaded on "
                                    f"this replica (at seq {state.seq}); `loractl list` shows "
                                    "what is", "args.adapter")
            lease = pool.acquire(loaded.slot)  # SlotDraining: admit once it is rewritten
            return Grant(loaded.slot, loaded.name, loaded.version, state.seq, lease)

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
            base = from_canonical(snap["seq"], snap["state"])
            if logical_digest(base) != snap["digest"]:
                raise BlobError(f"snapshot at seq {snap['seq']} does not match its digest")
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
        if new.pool is not None:
            self._check_model(new.pool)
        pool = self.pool
        if pool is None and new.pool is not None:
            pool = MemoryPool(pool_spec(new.pool))
        wanted = {a.slot: SlotHolder(a.name, a.version, a.sha256) for a in new.adapters.values()}
        writes: dict[int, SlotWeights] = {}
        for slot, holder in wanted.items():
            if self.holders.get(slot) != holder:
                adapter = new.adapters[holder.name]
                writes[slot] = slot_weights(self.blobs.get(adapter.sha256), adapter)
        clears = [s for s in self.holders if s not in wanted]
        # nothing has changed up to here; from here on nothing can fail
        assert pool is not None or not (writes or clears)
        with self.lock:
            for slot in clears:
                pool.clear_slot(slot)  # type: ignore[union-attr]
            for slot, weights in sorted(writes.items()):
                self.faults.write_slot(pool.write_slot, slot, weights)  # type: ignore[union-attr]
            self.pool, self.holders, self.state = pool, wanted, new
            self.log_id = log_id
        self.applied_at = time.time()
        self.last_error = None
        self._save_local_state()

    def _check_model(self, pool: PoolConfigured) -> None:
        if pool.fingerprint == self.model.fingerprint:
            return
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

    def _save_local_state(self) -> None:
        path = self.cache_dir / "state.msgpack"
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(canonical_bytes({"seq": self.state.seq, "state": canonical(self.state),
                                         "log_id": self.log_id}))
        os.replace(tmp, path)


class GapError(Exception):
    def __init__(self, expected: int, got: int) -> None:
        super().__init__(f"expected seq {expected}, got {got}")
        self.expected = expected
        self.got = got


__all__ = ["AdapterLoaded", "BlobError", "ForeignLog", "GapError", "ModelMismatch", "Phase",
           "Replica"]
