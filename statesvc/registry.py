"""The replica registry: which replica ids report to statesvc, who registered each, and
what they last reported (docs/security.md, "Replica ids").

An id is registered by its first heartbeat and belongs to the actor that sent it (a
replica key under --auth; without --auth every peer is `local`, first come). It moves
to another address only once it is STALE, and is forgotten after an hour of silence.
The registry holds at most `max_replicas` ids; `rows` costs the same whatever the
replicas report.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from shared.config import MAX_REPLICAS, REPLICA_STALE_AFTER_S
from shared.errors import CodedError

log = logging.getLogger("statesvc")

FORGET_AFTER_S = 3600.0  # a replica silent this long leaves `status`


class RegistryError(CodedError):
    """A heartbeat the registry refuses (`forbidden`, `conflict`, `overloaded`)."""


@dataclass
class _Registered:
    """A replica id in the registry: who registered it, and its last heartbeat."""

    owner: str  # the actor of its first heartbeat: a replica key under --auth, else `local`
    seen: float
    beat: dict[str, Any]
    previous_address: str | None = None  # set when the id moved to another address

    @property
    def address(self) -> str:
        return str(self.beat["address"])


class Registry:
    def __init__(self, *, max_replicas: int = MAX_REPLICAS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_replicas = max_replicas
        self.clock = clock
        self.ids: dict[str, _Registered] = {}

    def heartbeat(self, args: dict[str, Any], actor: str) -> None:
        """Register or refresh a replica id. An id belongs to the actor that registered it (a
        replica key under --auth; without --auth every peer is `local`, first come) and moves
        to another address only once it is STALE: a peer cannot take over a live replica's id."""
        now = self.clock()
        rid, address = args["id"], args["address"]
        reg = self.ids.get(rid)
        if reg is not None and now - reg.seen > FORGET_AFTER_S:
            del self.ids[rid]  # gone for an hour: registered anew
            reg = None
        if reg is None:
            self._make_room(now)
            log.info("replica %s registered by %s at %s", rid, actor, address)
            self.ids[rid] = _Registered(actor, now, dict(args))
            return
        if reg.owner != actor:
            raise RegistryError("forbidden", f"replica id {rid!r} is registered to {reg.owner}; "
                                f"{actor} may not heartbeat for it (give this replica its own "
                                "--replica-id)", "args.id")
        if address != reg.address:
            silent = now - reg.seen
            if silent < REPLICA_STALE_AFTER_S:
                raise RegistryError("conflict", f"replica id {rid!r} is live at {reg.address} "
                                    f"(last heartbeat {silent:.1f} s ago); another address may "
                                    f"take it only after {REPLICA_STALE_AFTER_S:g} s without "
                                    "one (STALE); give this replica its own --replica-id",
                                    "args.id")
            log.warning("replica %s moved from %s to %s (%s; it was STALE)", rid, reg.address,
                        address, actor)
            reg.previous_address = reg.address
        reg.seen, reg.beat = now, dict(args)

    def _make_room(self, now: float) -> None:
        """Room for one more id: forget the longest-silent STALE one at the cap, or refuse."""
        if len(self.ids) >= self.max_replicas:
            self._forget(now)
        if len(self.ids) < self.max_replicas:
            return
        rid, reg = min(self.ids.items(), key=lambda item: item[1].seen)
        if now - reg.seen < REPLICA_STALE_AFTER_S:
            raise RegistryError("overloaded", f"the replica registry is full: "
                                f"{self.max_replicas} live replica ids (--max-replicas); restart "
                                "statesvc with a larger --max-replicas, or stop replicas that "
                                "should not be there")
        log.warning("replica registry full (--max-replicas %d): forgot STALE replica %s at %s",
                    self.max_replicas, rid, reg.address)
        del self.ids[rid]

    def _forget(self, now: float) -> None:
        for gone in [r for r, reg in self.ids.items() if now - reg.seen > FORGET_AFTER_S]:
            del self.ids[gone]  # gone for an hour: no longer part of the fleet

    def rows(self, head: int, head_digest: Callable[[int], str | None]) -> list[dict[str, Any]]:
        """`status`'s replica rows; `head_digest(seq)` is the digest of a recent head, else None."""
        now = self.clock()
        self._forget(now)
        replicas = []
        for rid in sorted(self.ids):
            reg = self.ids[rid]
            hb, applied = reg.beat, reg.beat["applied_seq"]
            known = head_digest(applied)
            # None: an older seq than the recent heads (the replica is behind; not rebuilt)
            agrees = (False if applied > head else None if known is None
                      else known == hb["logical_digest"])
            row = {"id": rid, "address": reg.address,
                   "state": hb["state"] if now - reg.seen < REPLICA_STALE_AFTER_S else "STALE",
                   "applied_seq": applied, "logical_digest": hb["logical_digest"],
                   "pool_digest": hb["pool_digest"], "agrees": agrees}
            if reg.previous_address is not None:
                row["previous_address"] = reg.previous_address
            replicas.append(row)
        return replicas
