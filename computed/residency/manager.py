"""The residency manager: one owner of the tiers an adapter's weights pass through here.

After vLLM's `LoRAModelManager` (one manager over the device slots and the CPU cache) and
SGLang's `eviction_policy.py` (the choice of a slot is a policy of its own: slots.py). The
tiers, nearest the model first:

- `pool` and `slots`, the device tier: the JAX memory pool (pool.py) and the slot map of
  which registered version each slot holds (slots.py); made by `configure`;
- `host`, the host tier: parsed weights, LRU within a byte bound, and the worker that fetches
  and parses misses into it beside decode (host_tier.py);
- `blobs`, the blob cache: verified blobs on disk, fetched by sha256 from peers or statesvc
  (blob_cache.py).

The seam is `make_resident`: the only way an adapter's weights enter the pool, taken by the
sync (`reconcile`, after each advance of the log) and by admission (a request's miss) alike.
What may cross it: in, a registered `AdapterLoaded` and how it is wanted (pinned; for request
`ticket`; or with the weights the sync has parsed already); out, the slot that holds it, or
None (the sync's unpinned adapter finds no free slot: it waits for a request), or NoSlot,
Fetching, FetchFailed (a request waits, or is refused; no slot changed). Nothing else writes a
slot; `reconcile` clears the slots of versions that left the registry. The slot chosen is
slots.py's rule; how many adapters stay pinned is the reducer's (`shared.reducer.max_pinned`).
The caller holds the replica's lock: the state and the slots it names change together.
"""
from __future__ import annotations

import heapq
import time
from collections.abc import Callable

from computed.residency.blob_cache import BlobCache
from computed.residency.host_tier import FetchFailed, HostTier
from computed.residency.pool import LoraPool, MemoryPool, PoolSpec, SlotWeights
from computed.residency.slots import ResidentVersion, SlotMap
from computed.serving.admission import NoSlot
from shared.events import AdapterLoaded, PoolConfigured
from shared.faults import NO_FAULTS, Faults
from shared.reducer import State, max_pinned


def pool_spec(pool: PoolConfigured) -> PoolSpec:
    return PoolSpec(num_layers=pool.num_layers,
                    module_dims={m: pool.module_dims[m] for m in pool.targets},
                    slots=pool.max_loras, max_rank=pool.max_rank, dtype=pool.dtype)


class ResidencyManager:
    """The device slots, the host tier and the blob cache of one replica (module docstring)."""

    def __init__(self, blobs: BlobCache, host_bytes: int, *, faults: Faults = NO_FAULTS,
                 pool_layout: Callable[[PoolSpec], LoraPool] | None = None) -> None:
        self.blobs = blobs
        self.host = HostTier(blobs, host_bytes)
        self.pool: MemoryPool | None = None  # None until the pool is configured
        self.slots: SlotMap | None = None
        self.faults = faults  # test-only (shared/faults.py): off unless switched on
        self.pool_layout = pool_layout  # the pool's shardings on a mesh (`--tensor-parallel`)

    def configure(self, pool: PoolConfigured) -> tuple[MemoryPool, SlotMap]:
        """The device tier for `pool`, made empty; the caller makes it the manager's
        (`adopt`) once nothing can fail."""
        spec = pool_spec(pool)
        memory = MemoryPool(spec, shardings=None if self.pool_layout is None
                            else self.pool_layout(spec))
        return memory, SlotMap(memory.spec.slots, busy=memory.busy)

    def adopt(self, pool: MemoryPool | None, slots: SlotMap | None) -> None:
        self.pool, self.slots = pool, slots

    # ---- the one way into the pool ------------------------------------------------

    def make_resident(self, adapter: AdapterLoaded, *, pinned: bool = False,
                      ticket: int | None = None, weights: SlotWeights | None = None,
                      pool: MemoryPool | None = None, slots: SlotMap | None = None,
                      ) -> int | None:
        """Write `adapter` into a slot unless one holds it; returns that slot. `ticket`: a
        request's miss, whose weights come from the host tier (raises NoSlot while no slot
        can be had, Fetching while they are fetched, FetchFailed when they could not be).
        Else the sync's fill with `weights`: a pinned adapter takes a slot whatever it holds
        (its write may wait for the slot's leases), an unpinned one only a free slot
        (None without one). `pool` and `slots`: a device tier not adopted yet."""
        pool = self.pool if pool is None else pool
        slots = self.slots if slots is None else slots
        assert pool is not None and slots is not None
        slot = slots.slot_of(adapter.name, adapter.version)
        if slot is not None:
            return slot
        if ticket is not None:
            slot = slots.victim(ticket)
            if slot is None:
                self.host.want(adapter)  # fetched and parsed while the request waits
                slots.wait(ticket)
                raise NoSlot(f"all {slots.slots} slots are leased, pinned or reserved")
        elif pinned:
            slot = slots.pinned_victim()
        else:  # a free slot reserved for a waiting request stays for it
            slot = next((f for f in slots.free_slots() if not slots.blocked(f, -1)), None)
            if slot is None:
                return None
        if weights is not None:
            self.faults.write_slot(pool.write_slot, slot, weights)
        else:
            try:
                took = self.host.take(adapter)  # Fetching: it waits, holding no slot
            except FetchFailed:
                if ticket is not None:  # no slot stays reserved while they cannot be had
                    slots.forget(ticket)
                raise
            t0 = time.perf_counter()
            self.faults.write_slot(pool.write_slot, slot, took.weights)
            self.host.wrote(took, time.perf_counter() - t0)
        holder = ResidentVersion(adapter.name, adapter.version, adapter.sha256, pinned)
        slots.fill(slot, holder, ticket=ticket, demand=ticket is not None)
        return slot

    # ---- after an advance of the log ---------------------------------------------

    def wanted(self, new: State, slots: SlotMap) -> list[tuple[AdapterLoaded, bool]]:
        """The adapters to make resident at `new`, each with whether it is pinned: the pinned
        ones (the oldest the reducer's limit allows: a log from before the limit may pin more),
        then as many of the newest unpinned ones as there are slots left, oldest first."""
        assert new.pool is not None
        pinned = new.pinned()[:max_pinned(new.pool)]
        keep = {(h.name, h.version) for h in slots.holders.values()}
        out = [(a, True) for a in pinned if (a.name, a.version) not in keep]
        staying = sum(1 for h in slots.holders.values()
                      if (cur := new.adapters.get(h.name)) is not None and cur.version == h.version)
        room = slots.slots - staying - len(out)
        if room <= 0:  # the usual case once the registry outgrows the slots: no scan
            return out
        names = {a.name for a in pinned}
        rest = heapq.nlargest(room, (a for a in new.adapters.values() if a.name not in names
                                     and (a.name, a.version) not in keep),
                              key=lambda a: a.version)
        return out + [(a, False) for a in reversed(rest)]

    def reconcile(self, new: State, pool: MemoryPool, slots: SlotMap,
                  fills: list[tuple[AdapterLoaded, bool]],
                  weights: dict[str, SlotWeights]) -> None:
        """Take the registry `new` into the device tier (nothing here can fail): slots whose
        version left it stop routing and are cleared when their leases end; `fills` (from
        `wanted`, their `weights` parsed) are made resident."""
        for slot, h in list(slots.holders.items()):
            cur = new.adapters.get(h.name)
            if cur is None or cur.version != h.version:
                slots.drop(slot)
                pool.clear_slot(slot)  # now, or when its last lease ends
        for adapter, pinned in fills:
            self.make_resident(adapter, pinned=pinned, weights=weights[adapter.name],
                               pool=pool, slots=slots)

    def want(self, adapter: AdapterLoaded, *, demand: bool = True) -> None:
        """A request for `adapter` was queued: unless a slot holds it, start fetching and
        parsing it into the host tier now, beside the decode steps."""
        if self.slots is not None and self.slots.slot_of(adapter.name, adapter.version) is None:
            self.host.want(adapter, demand=demand)

    def retain(self, new: State) -> None:
        """Versions that left the registry leave the host tier and the fill queue; the blob
        cache keeps the blobs of what is in a slot or the host tier (or on its way there) and
        may remove the others to fit its bound."""
        self.host.retain(lambda n, v: (a := new.adapters.get(n)) is not None
                         and a.version == v)
        holders = dict(self.slots.holders) if self.slots is not None else {}  # a copy: no lock
        in_use = {h.sha256 for h in holders.values()}
        for name, version in self.host.versions():
            if (a := new.adapters.get(name)) is not None and a.version == version:
                in_use.add(a.sha256)
        self.blobs.keep(frozenset(in_use))


__all__ = ["ResidencyManager", "pool_spec"]
