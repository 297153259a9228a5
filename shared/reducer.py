"""The reducer: the state of the pool as a pure function of the log.

`apply(state, seq, body)` is the only way state changes. The state service runs
it before appending (so a command that would break a rule is refused and
nothing is stored), and every replica runs it on the same events, so all of
them derive the same registry and the same logical digest. The rules of a `load`
that need no file (the name, the registry's cap, the pinned limit, an existing version)
are here only:
`admit_load` asks them before the service reads the adapter, `apply` again on
the event.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from typing import Any

import msgpack

from shared.canonical import canonical_bytes, digest
from shared.config import ADAPTER_NAME_RE, ADAPTER_NAME_WORDS, MAX_SEQ, UUID_RE
from shared.errors import CodedError
from shared.events import (AdapterLoaded, AdapterUnloaded, Body, EventError, PoolConfigured,
                           decode_body, encode_body, lora_scaling)


class ReducerError(CodedError, ValueError):
    """An event that the state at its seq does not admit."""


@dataclass(frozen=True)
class State:
    """The registry: every adapter version the log holds live, by name. Which device slot
    holds one is each replica's own choice (computed/residency/slots.py), never part of the state."""

    seq: int = 0
    pool: PoolConfigured | None = None
    adapters: dict[str, AdapterLoaded] = field(default_factory=dict)

    def pinned(self) -> list[AdapterLoaded]:
        """The pinned adapters, oldest version first."""
        return sorted((a for a in self.adapters.values() if a.pinned), key=lambda a: a.version)


def require_pool(state: State) -> PoolConfigured:
    if state.pool is None:
        raise ReducerError("not_configured", "the pool is not configured yet; run "
                           "`loractl pool init --model DIR ...` first")
    return state.pool


def max_pinned(pool: PoolConfigured) -> int:
    """At most max_loras - 1 adapters are pinned, so one slot always cycles."""
    return pool.max_loras - 1


def _check_name(name: str, field: str | None = None) -> None:
    """Raise ReducerError (invalid_name) unless `name` is an adapter name."""
    if not ADAPTER_NAME_RE.fullmatch(name):
        raise ReducerError("invalid_name", f"adapter name {name!r} must match "
                           f"{ADAPTER_NAME_RE.pattern}: {ADAPTER_NAME_WORDS}", field)


def _registry_full(pool: PoolConfigured) -> ReducerError:
    return ReducerError("registry_full", f"the registry holds {pool.max_adapters} adapters, its "
                        "cap (--max-adapters); unload an adapter first (loractl unload NAME), or "
                        "configure a new pool with a larger --max-adapters")


def _exists(old: AdapterLoaded, new: AdapterLoaded) -> ReducerError:
    """`new` would record a version of a loaded name without replacing it."""
    what = (f"sha256 {old.sha256[:12]}..., new {new.sha256[:12]}..."
            if old.sha256 != new.sha256 else
            f"pinned={old.pinned}, asked pinned={new.pinned}"
            if old.pinned != new.pinned else "other rank, alpha or targets")
    return ReducerError("exists", f"adapter {new.name!r} is already loaded as version "
                        f"{old.version} with different content or settings ({what}); "
                        "pass --replace to record a new version")


def admit_load(state: State, name: str, *, pin: bool = False) -> AdapterLoaded | None:
    """What a `load` of `name` needs of the state before any file is read: the loaded version
    it would replace (None: a new name). Raises ReducerError when the state admits no load of
    `name`: no pool, a bad name, a full registry, or one pinned adapter too many."""
    pool = require_pool(state)
    _check_name(name, "args.name")
    old = state.adapters.get(name)
    if old is None and len(state.adapters) >= pool.max_adapters:
        raise _registry_full(pool)
    if pin and not (old is not None and old.pinned):
        # checked here, not in `apply`: a log from before this rule may pin every slot, and it
        # must still replay (replicas then keep only the oldest max_loras - 1 pinned)
        pinned = len(state.pinned())
        if pinned >= max_pinned(pool):
            raise ReducerError("too_many_pinned", f"{pinned} adapters are already pinned, the "
                               f"most a pool of --max-loras {pool.max_loras} slots allows "
                               f"(max_loras - 1: one slot must always cycle so that every "
                               "other adapter can still be served); unpin one (loractl unload "
                               "NAME --force, then load it without --pin), load this one "
                               "without --pin, or configure a new pool with a larger "
                               "--max-loras", "args.pin")
    return old


def _check_loaded(state: State, seq: int, ev: AdapterLoaded) -> None:
    pool = require_pool(state)
    _check_name(ev.name)
    if ev.version != seq:
        raise ReducerError("invalid", f"version {ev.version} of {ev.name!r} must equal its seq {seq}")
    if not 1 <= ev.rank <= pool.max_rank:
        raise ReducerError("invalid", f"adapter {ev.name!r} has rank {ev.rank}, above the pool's "
                           f"--max-rank {pool.max_rank}; configure a new pool with a larger "
                           "--max-rank or retrain the adapter with a smaller r")
    if not ev.targets or not set(ev.targets) <= set(pool.targets):
        raise ReducerError("invalid", f"adapter {ev.name!r} targets {list(ev.targets)}; the pool "
                           f"holds {list(pool.targets)}")
    if ev.scaling != lora_scaling(ev.alpha, ev.rank, ev.use_rslora):
        raise ReducerError("invalid", f"adapter {ev.name!r}: scaling {ev.scaling} does not follow "
                           "from alpha and rank")
    old = state.adapters.get(ev.name)
    if old is None and ev.replaces is not None:
        raise ReducerError("not_found", f"{ev.name!r} replaces a version that is not loaded")
    if old is None and len(state.adapters) >= pool.max_adapters:
        raise _registry_full(pool)
    if old is not None:
        if ev.replaces is None:
            raise _exists(old, ev)
        if ev.replaces.version != old.version:
            raise ReducerError("exists", f"adapter {ev.name!r} is loaded as version "
                               f"{old.version}; a new version must replace it (loractl load "
                               "--replace)")


def apply(state: State, seq: int, body: Body) -> State:
    """The state after the event `body` recorded at `seq`."""
    if seq != state.seq + 1:
        raise ReducerError("invalid", f"event seq {seq} does not follow {state.seq}")
    if isinstance(body, PoolConfigured):
        if state.pool is not None:
            raise ReducerError("already_configured", "the pool is already configured; its "
                               "settings are immutable")
        return State(seq, body, {})
    if isinstance(body, AdapterLoaded):
        _check_loaded(state, seq, body)
        adapters = dict(state.adapters)
        adapters[body.name] = body if body.replaces is None else replace(body, replaces=None)
        return State(seq, state.pool, adapters)
    if isinstance(body, AdapterUnloaded):
        require_pool(state)
        cur = state.adapters.get(body.name)
        if cur is None:
            raise ReducerError("not_found", f"adapter {body.name!r} is not loaded")
        if cur.version != body.version:
            raise ReducerError("invalid", f"unload of {body.name!r} names version {body.version}; "
                               f"loaded is version {cur.version}")
        adapters = dict(state.adapters)
        del adapters[body.name]
        return State(seq, state.pool, adapters)
    raise ReducerError("invalid", f"unknown event body {body!r}")


def canonical(state: State) -> dict[str, Any]:
    """The state as plain data, without its seq: what digests and snapshots hold."""
    return {
        "pool": None if state.pool is None else encode_body(state.pool),
        "adapters": [encode_body(state.adapters[n]) for n in sorted(state.adapters)],
    }


def logical_digest(state: State) -> str:
    """sha256 of the canonical msgpack of the state (the seq is not part of it)."""
    return hashlib.sha256(snapshot_bytes(state)).hexdigest()


def snapshot_bytes(state: State) -> bytes:
    """`canonical_bytes(canonical(state))`, assembled from each body's canonical bytes, which
    are computed once per body object and kept on it (`_body_bytes`): successive states share
    their bodies, so a digest or a snapshot of a large registry packs only what changed."""
    packer = msgpack.Packer(use_bin_type=True)
    # a map of two keys in sorted order: "adapters" (an array of bodies by name), "pool"
    return b"".join([b"\x82", packer.pack("adapters"), packer.pack_array_header(len(state.adapters)),
                     *[_body_bytes(state.adapters[n]) for n in sorted(state.adapters)],
                     packer.pack("pool"),
                     canonical_bytes(None) if state.pool is None else _body_bytes(state.pool)])


_BYTES_ATTR = "_canonical_bytes"


def _body_bytes(body: Body) -> bytes:
    """canonical_bytes(encode_body(body)), cached on the (frozen, immutable) body itself: by
    identity, so it dies with the body and is never shared between two bodies."""
    cached: bytes | None = body.__dict__.get(_BYTES_ATTR)
    if cached is None:
        cached = canonical_bytes(encode_body(body))
        object.__setattr__(body, _BYTES_ATTR, cached)
    return cached


def verified_snapshot(seq: int, data: dict[str, Any], expected: str) -> State:
    """The state a snapshot holds, once it hashes to the digest stored with it: the state read
    from the data must have that logical digest (which also caches each body's canonical bytes
    for the digests and saves that follow), else the data as recorded must: a snapshot written
    before the registry split holds slots and a digest of them (digest version 1), and is
    upcast only after that check."""
    try:
        state: State | None = from_canonical(seq, data)
    except EventError:
        state = None
    if state is not None and logical_digest(state) == expected:
        return state
    if digest(data) != expected:
        raise EventError(f"snapshot at seq {seq} does not match its digest")
    return state if state is not None else from_canonical(seq, data)


def from_canonical(seq: int, data: dict[str, Any]) -> State:
    """Inverse of `canonical`."""
    try:
        pool = None if data["pool"] is None else decode_body(PoolConfigured.TYPE, data["pool"])
        adapters = [decode_body(AdapterLoaded.TYPE, a) for a in data["adapters"]]
    except (KeyError, TypeError) as exc:
        raise EventError(f"snapshot is malformed: {exc}") from None
    assert pool is None or isinstance(pool, PoolConfigured)
    return State(seq, pool, {a.name: a for a in adapters if isinstance(a, AdapterLoaded)})


def diff_of(seq: int, body: Body, *, log_id: str | None) -> dict[str, Any]:
    """What one event changes, as published on the diff stream, with the log it belongs to."""
    if isinstance(body, PoolConfigured):
        return {"seq": seq, "op": "configure", "log_id": log_id, "pool": encode_body(body)}
    if isinstance(body, AdapterLoaded):
        return {"seq": seq, "op": "load", "log_id": log_id, **encode_body(body)}
    return {"seq": seq, "op": "unload", "log_id": log_id, **encode_body(body)}


_OP_TYPES = {"configure": PoolConfigured.TYPE, "load": AdapterLoaded.TYPE,
             "unload": AdapterUnloaded.TYPE}
_TYPE_OPS = {t: op for op, t in _OP_TYPES.items()}
_DIFF_ENVELOPE = ("seq", "op", "log_id")


def diff_of_payload(seq: int, type_: str, payload: dict[str, Any], *,
                    log_id: str | None) -> dict[str, Any]:
    """`diff_of(seq, body)` from the body's payload as `encode_body` made it (every field, in
    order), without decoding it: for events the state service has just appended."""
    op = _TYPE_OPS[type_]
    if op == "configure":
        return {"seq": seq, "op": op, "log_id": log_id, "pool": payload}
    return {"seq": seq, "op": op, "log_id": log_id, **payload}


def body_of_diff(diff: dict[str, Any]) -> tuple[int, Body]:
    """Inverse of `diff_of`: (seq, body); raises EventError on a malformed diff. Its `log_id`
    (absent, null or a lowercase UUID) is checked here and read by the caller."""
    try:
        seq, op, log_id = diff["seq"], diff["op"], diff.get("log_id")
        if type(seq) is not int or not 1 <= seq <= MAX_SEQ:
            raise EventError(f"diff seq must be an int from 1 to 2**62, got {seq!r}")
        if log_id is not None and not (isinstance(log_id, str) and UUID_RE.fullmatch(log_id)):
            raise EventError(f"diff log_id must be null or a lowercase UUID, got {log_id!r}")
        fields_ = {k: v for k, v in diff.items() if k not in _DIFF_ENVELOPE}
        if op == "configure":
            if set(fields_) != {"pool"}:
                raise EventError(f"a configure diff holds only its pool, got {sorted(fields_)}")
            return seq, decode_body(PoolConfigured.TYPE, diff["pool"])
        return seq, decode_body(_OP_TYPES[op], fields_)
    except EventError:
        raise
    except (KeyError, TypeError, ValueError, OverflowError, AttributeError) as exc:
        raise EventError(f"malformed diff: {exc}") from None
