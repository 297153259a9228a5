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
"""
from __future__ import annotations

import enum
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from computed.pool import MemoryPool, PoolSpec, SlotWeights
from computed.weights import BlobCache, BlobError, slot_weights
from shared.canonical import canonical_bytes
from shared.client import ControlClient
from shared.events import AdapterLoaded, Body, PoolConfigured, decode_body
from shared.fingerprint import ModelInfo
from shared.reducer import State, apply, canonical, from_canonical, logical_digest

log = logging.getLogger("computed")
NO_POOL = "none"
PENDING = "pending"


class Phase(enum.Enum):
    INITIAL = "INITIAL"    # nothing applied yet
    SYNCING = "SYNCING"    # fetching the snapshot and the events after it
    ACTIVE = "ACTIVE"      # following the diff stream


class ModelMismatch(Exception):
    """The replica's model is not the one the pool was configured for: it must not serve."""


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
                 from_zero: bool = False, perturb_slot: int | None = None,
                 slow_write_s: float = 0.0) -> None:
        self.model = model
        self.from_zero = from_zero  # replay the whole log: no snapshot, no local state
        self.perturb_slot = perturb_slot  # test-only fault: this slot is written wrong
        self.slow_write_s = slow_write_s  # test-only fault: a pause after each slot write
        self.syncing_seq = 0  # how far a catch-up has read the log
        self.client = client
        self.cache_dir = Path(cache_dir)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self.blobs = BlobCache(self.cache_dir / "blobs", client)
        self.state = State()
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

    # ---- sync ------------------------------------------------------------------

    def bootstrap(self) -> None:
        """Reach the head from the local state (warm cache), statesvc's latest snapshot, or,
        with `from_zero`, from an empty state and every event of the log."""
        self.phase = Phase.SYNCING
        base = None if self.from_zero else self._local_state()
        if base is None and self.from_zero:
            base = State()
        elif base is None:
            snap = self.client.call("snapshot")
            base = from_canonical(snap["seq"], snap["state"])
            if logical_digest(base) != snap["digest"]:
                raise BlobError(f"snapshot at seq {snap['seq']} does not match its digest")
        try:
            self.catch_up(base)
        except BlobError:
            if base.seq > self.state.seq:  # serve what can be served while the rest is retried
                try:
                    self._advance_to(base)
                except BlobError:
                    pass
            raise
        self.phase = Phase.ACTIVE

    def catch_up(self, base: State | None = None) -> int:
        """Fetch every event after `base` (default: the applied state), reduce their metadata
        up to the head, then reconcile the pool once; returns how many events were read."""
        state = self.state if base is None else base
        read = 0
        while True:
            page = self.client.call("events", {"since": state.seq})["events"]
            if not page:
                break
            for ev in page:
                state = apply(state, ev["seq"], decode_body(ev["type"], ev["payload"]))
            read += len(page)
            self.syncing_seq = state.seq
        if state is not self.state:
            self._advance_to(state)
        return read

    def apply_events(self, events: list[tuple[int, Body]]) -> None:
        """Apply consecutive events from applied+1 on (older ones are dropped)."""
        events = [e for e in events if e[0] > self.state.seq]
        if not events:
            return
        if events[0][0] != self.state.seq + 1:
            raise GapError(self.state.seq + 1, events[0][0])
        state = self.state
        for seq, body in events:
            state = apply(state, seq, body)
        self._advance_to(state)

    def _advance_to(self, new: State) -> None:
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
                if slot == self.perturb_slot:
                    writes[slot] = _perturbed(writes[slot])
        clears = [s for s in self.holders if s not in wanted]
        # nothing has changed up to here; from here on nothing can fail
        assert pool is not None or not (writes or clears)
        with self.lock:
            for slot in clears:
                pool.clear_slot(slot)  # type: ignore[union-attr]
            for slot, weights in sorted(writes.items()):
                pool.write_slot(slot, weights)  # type: ignore[union-attr]
                if self.slow_write_s:  # test-only fault: widen the window for a crash here
                    time.sleep(self.slow_write_s)
            self.pool, self.holders, self.state = pool, wanted, new
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
        path = self.cache_dir / "state.msgpack"
        try:
            saved = msgpack.unpackb(path.read_bytes())
            state = from_canonical(saved["seq"], saved["state"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if state.seq == 0:
            return None
        # the log this cache followed must be the log statesvc has now
        try:
            remote = self.client.call("digest", {"seq": state.seq})["digest"]
        except Exception as exc:  # not_found: statesvc's log is shorter, i.e. another log
            log.warning("discarding the local state at seq %d: %s", state.seq, exc)
            return None
        if remote != logical_digest(state):
            log.warning("discarding the local state at seq %d: statesvc's digest differs",
                        state.seq)
            return None
        return state

    def _save_local_state(self) -> None:
        path = self.cache_dir / "state.msgpack"
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(canonical_bytes({"seq": self.state.seq, "state": canonical(self.state)}))
        os.replace(tmp, path)


def _perturbed(w: SlotWeights) -> SlotWeights:
    """The test-only fault: one weight of the slot nudged, as a bad write would leave it."""
    (first, (a, b)), *rest = sorted(w.pairs.items())
    a = a.copy()
    a.flat[0] += 0.5
    return SlotWeights(w.scaling, w.rank, dict([(first, (a, b)), *rest]))


class GapError(Exception):
    def __init__(self, expected: int, got: int) -> None:
        super().__init__(f"expected seq {expected}, got {got}")
        self.expected = expected
        self.got = got


__all__ = ["AdapterLoaded", "BlobError", "GapError", "ModelMismatch", "Phase", "Replica"]
