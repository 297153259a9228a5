"""Event types of the adapter log, as frozen dataclasses.

A stored event is an `Event` (its envelope: seq, event_id, type, recorded_at,
actor) around one of the typed bodies below; `payload` is the body as JSON.
"""
from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Union

from shared.config import DEFAULT_MAX_ADAPTERS, SHA256_RE, UUID_RE
from shared.projections import MODULES


class EventError(ValueError):
    """A stored or received event does not have the shape of its type."""


def lora_scaling(alpha: float, rank: int, use_rslora: bool) -> float:
    """PEFT's scaling: alpha / r, or alpha / sqrt(r) with rsLoRA."""
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


@dataclass(frozen=True)
class PoolConfigured:
    """Genesis: the immutable pool settings and the base model they are for."""

    TYPE: ClassVar[str] = "pool.configured"
    fingerprint: str
    model_config: dict[str, Any]
    num_layers: int
    module_dims: dict[str, tuple[int, int]]  # every target module -> (in, out)
    max_loras: int  # device slots per replica: the most distinct adapters one batch holds
    max_rank: int
    targets: tuple[str, ...]
    dtype: str
    # the log's identity, a uuid4 chosen by statesvc at pool.init; None in a log written before
    # log ids existed (see `log_id_of`), and then left out of the payload, so its digests stay
    log_id: str | None = None
    # the registry's cap (--max-adapters); a genesis recorded before it existed upcasts to the
    # default when read (`decode_body`)
    max_adapters: int = DEFAULT_MAX_ADAPTERS
    # the sha256 of the base model's weights (shared/fingerprint.py `weights_digest`); None in
    # a log written before it was recorded, and then left out of the payload, so its digests stay
    weights_sha256: str | None = None


@dataclass(frozen=True)
class Replaced:
    version: int


@dataclass(frozen=True)
class AdapterLoaded:
    TYPE: ClassVar[str] = "adapter.loaded"
    name: str
    version: int  # the seq of this event
    sha256: str
    size: int
    rank: int
    alpha: float
    scaling: float
    use_rslora: bool
    targets: tuple[str, ...]
    pinned: bool
    replaces: Replaced | None = None


@dataclass(frozen=True)
class AdapterUnloaded:
    TYPE: ClassVar[str] = "adapter.unloaded"
    name: str
    version: int


Body = Union[PoolConfigured, AdapterLoaded, AdapterUnloaded]
_FIELDS = {cls: fields(cls) for cls in (PoolConfigured, AdapterLoaded, AdapterUnloaded)}
BODY_TYPES: dict[str, type[PoolConfigured] | type[AdapterLoaded] | type[AdapterUnloaded]] = {
    cls.TYPE: cls for cls in (PoolConfigured, AdapterLoaded, AdapterUnloaded)}


@dataclass(frozen=True)
class Event:
    seq: int
    event_id: str
    type: str
    payload: dict[str, Any]
    recorded_at: str  # ISO 8601, UTC
    actor: str

    @property
    def body(self) -> Body:
        return decode_body(self.type, self.payload)

    def to_wire(self) -> dict[str, Any]:
        # asdict(self) without its deep copy: the payload dict is shared, not copied
        return {"seq": self.seq, "event_id": self.event_id, "type": self.type,
                "payload": self.payload, "recorded_at": self.recorded_at, "actor": self.actor}


def encode_body(body: Body) -> dict[str, Any]:
    """The JSON payload of a body: plain dicts and lists (on the hot path: no deep copy)."""
    out = {f.name: getattr(body, f.name) for f in _FIELDS[type(body)]}
    if "targets" in out:
        out["targets"] = list(out["targets"])
    if isinstance(body, AdapterLoaded) and body.replaces is not None:
        out["replaces"] = {"version": body.replaces.version}
    if isinstance(body, PoolConfigured):
        out["model_config"] = dict(body.model_config)
        out["module_dims"] = {m: list(d) for m, d in body.module_dims.items()}
        if body.log_id is None:
            del out["log_id"]
        if body.weights_sha256 is None:
            del out["weights_sha256"]
    return out


# Names the logs written before log ids existed (`log_id_of`); never change it.
LEGACY_LOG_NAMESPACE = uuid.UUID("6f1c4a52-2d0e-4b7f-9a1e-3c5d8e0b7a41")


def log_id_of(genesis: Event) -> str:
    """The identity of the log that `genesis` (its pool.configured event) begins: the log_id
    recorded in it or, in a log written before log ids existed, a uuid5 of the genesis's
    event_id and recorded_at, which are stored with it and never change."""
    recorded = genesis.payload.get("log_id")
    if isinstance(recorded, str):
        return recorded
    return str(uuid.uuid5(LEGACY_LOG_NAMESPACE, f"{genesis.event_id} {genesis.recorded_at}"))


_MODULE_SET = frozenset(MODULES)


def _ordered_targets(value: Any) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not _MODULE_SET.issuperset(value):
        raise EventError(f"targets must be a list of {', '.join(MODULES)}; got {value!r}")
    return tuple(m for m in MODULES if m in value)


# The type of each scalar field of the bodies (float fields also take ints).
_FIELD_TYPES: dict[str, type] = {
    "fingerprint": str, "model_config": dict, "num_layers": int, "max_loras": int,
    "max_rank": int, "dtype": str, "name": str, "version": int, "slot": int, "sha256": str,
    "size": int, "rank": int, "alpha": float, "scaling": float, "use_rslora": bool,
    "pinned": bool, "log_id": str, "max_adapters": int, "weights_sha256": str}


def upcast(type_: str, payload: dict[str, Any]) -> dict[str, Any]:
    """A payload as today's types read it. Events recorded before the registry and residency
    split (docs/residency.md) carry the slot their adapter went to (`slot`, `replaces.slot`):
    which slot holds an adapter is now each replica's own choice, so the slot is dropped.
    Genesis events from before --max-adapters take the default. The stored row is unchanged."""
    if type_ == PoolConfigured.TYPE:
        return payload if "max_adapters" in payload else {**payload,
                                                          "max_adapters": DEFAULT_MAX_ADAPTERS}
    if "slot" not in payload and not isinstance(payload.get("replaces"), dict):
        return payload
    out = {k: v for k, v in payload.items() if k != "slot"}
    if "slot" in payload and type(payload["slot"]) is not int:  # malformed: refused below
        out["slot"] = payload["slot"]
    replaces = out.get("replaces")
    if isinstance(replaces, dict) and "slot" in replaces:
        out["replaces"] = {k: v for k, v in replaces.items() if k != "slot"}
    return out


def _check_types(type_: str, payload: dict[str, Any]) -> None:
    for name, value in payload.items():
        kind = _FIELD_TYPES.get(name)
        if kind is None or type(value) is kind or (kind is float and type(value) is int):
            continue
        raise EventError(f"{type_}.{name} must be {kind.__name__}, got {type(value).__name__}")


_FIELD_NAMES = {cls: frozenset(f.name for f in fields(cls)) for cls in BODY_TYPES.values()}


def decode_body(type_: str, payload: dict[str, Any]) -> Body:
    """The typed body of a payload; raises EventError when it does not fit the type."""
    cls = BODY_TYPES.get(type_)
    if cls is None:
        raise EventError(f"unknown event type {type_!r}")
    names = _FIELD_NAMES[cls]
    if isinstance(payload, dict):
        payload = upcast(type_, payload)
    if not isinstance(payload, dict) or not set(payload) <= names:
        raise EventError(f"{type_} payload has unexpected fields: {sorted(set(payload) - names)}")
    _check_types(type_, payload)
    if "log_id" in payload and not UUID_RE.fullmatch(payload["log_id"]):
        raise EventError(f"{type_}.log_id must be a lowercase UUID, got {payload['log_id']!r}")
    if "weights_sha256" in payload and not SHA256_RE.fullmatch(payload["weights_sha256"]):
        raise EventError(f"{type_}.weights_sha256 must be 64 lowercase hex digits, got "
                         f"{payload['weights_sha256']!r}")
    try:
        data = dict(payload)
        if "targets" in data:
            data["targets"] = _ordered_targets(data["targets"])
        if cls is PoolConfigured:
            data["module_dims"] = {m: (int(d[0]), int(d[1])) for m, d in data["module_dims"].items()}
        if cls is AdapterLoaded:
            data["alpha"], data["scaling"] = float(data["alpha"]), float(data["scaling"])
            if data.get("replaces") is not None:
                data["replaces"] = Replaced(**data["replaces"])
        return cls(**data)
    except (TypeError, KeyError, IndexError, AttributeError, ValueError, OverflowError) as exc:
        raise EventError(f"{type_} payload is malformed: {exc}") from None
