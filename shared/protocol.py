"""The wire protocol: msgpack frames, their limits and their schemas.

Every inbound frame goes through `unpack` and then `decode_request`: size
limit, msgpack without ext types, plain types only, then a strict schema for
the envelope and for the command's arguments. Errors name the field. See
docs/protocol.md for the frames and what each side does with them.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import msgpack

from shared.config import (ADAPTER_NAME_RE, ADAPTER_NAME_WORDS, DEFAULT_MAX_ADAPTERS,
                           MAX_BLOB_CHUNK, MAX_EVENTS_PER_PAGE, MAX_FRAME_BYTES, MAX_LIST_PAGE,
                           MAX_MAX_ADAPTERS, MAX_SEQ, POOL_DTYPES, PROTOCOL_VERSION,
                           SHA256_RE, UUID_RE)
from shared.endpoints import EndpointError, parse_endpoint
from shared.errors import CodedError
from shared.projections import MODULES

_POOL_DIGEST_RE = re.compile(r"[0-9a-f]{64}|none|pending")
_PLAIN = (type(None), bool, int, float, str, bytes)
_PLAIN_TYPES = frozenset(_PLAIN)


class ProtocolError(CodedError, ValueError):
    """A frame that does not follow the protocol; `code` goes into the error reply."""


def pack(value: Any) -> bytes:
    packed: bytes = msgpack.packb(value, use_bin_type=True)
    return packed


def no_ext(code: int, data: bytes) -> Any:
    raise ProtocolError("bad_frame", f"msgpack ext type {code} is not allowed")


def _check_plain(value: Any, depth: int = 0) -> None:
    """Refuse what msgpack decoded that is not plain data, or nests deeper than 32 levels.
    Scalars are checked in their container's loop: a snapshot holds a million of them."""
    if depth > 32:
        raise ProtocolError("bad_frame", "frame nests deeper than 32 levels")
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ProtocolError("bad_frame", f"map keys must be strings, got {type(k).__name__}")
            if depth >= 32 or type(v) not in _PLAIN_TYPES:  # else a scalar that may be here
                _check_plain(v, depth + 1)
    elif isinstance(value, list):
        for v in value:
            if depth >= 32 or type(v) not in _PLAIN_TYPES:
                _check_plain(v, depth + 1)
    elif not isinstance(value, _PLAIN):
        raise ProtocolError("bad_frame", f"{type(value).__name__} values are not allowed")


def unpack(frame: bytes | memoryview, *, max_bytes: int = MAX_FRAME_BYTES) -> Any:
    """Decode one msgpack frame, refusing oversized frames, ext types and trailing bytes."""
    if len(frame) > max_bytes:
        raise ProtocolError("too_large", f"frame of {len(frame)} bytes is above the "
                            f"{max_bytes}-byte limit")
    try:
        value = msgpack.unpackb(frame, raw=False, strict_map_key=True, use_list=True,
                                ext_hook=no_ext)
    except ProtocolError:
        raise
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError,
            UnicodeDecodeError, TypeError) as exc:
        raise ProtocolError("bad_frame", "not a valid msgpack frame: "
                            f"{exc or type(exc).__name__}") from None
    _check_plain(value)
    return value


# ---- schemas -------------------------------------------------------------

Check = Callable[[Any], "str | None"]


@dataclass(frozen=True)
class Field:
    kind: type | tuple[type, ...]
    required: bool = True
    default: Any = None
    check: Check | None = None


def int_range(lo: int, hi: int) -> Check:
    return lambda v: None if lo <= v <= hi else f"must be between {lo} and {hi}"


def str_len(hi: int) -> Check:
    return lambda v: None if 0 < len(v) <= hi else f"must be 1 to {hi} characters"


def matches(pattern: re.Pattern[str], what: str) -> Check:
    return lambda v: None if pattern.fullmatch(v) else f"must be {what}"


def one_of(*choices: str) -> Check:
    return lambda v: None if v in choices else f"must be one of {', '.join(choices)}"


def _targets(v: Any) -> str | None:
    if isinstance(v, str):
        return None if v == "all" else "must be 'all' or a list of module names"
    if not v or not all(isinstance(m, str) and m in MODULES for m in v) or len(set(v)) != len(v):
        return f"must be 'all' or a non-empty list of distinct modules from {', '.join(MODULES)}"
    return None


def _replica_endpoint(v: str) -> str | None:
    """A replica's listen address as it reports it: what the drill and `loractl status` will
    connect to, so one plain endpoint (shared/endpoints.py)."""
    if len(v) > 256:
        return "must be at most 256 characters"
    try:
        parse_endpoint(v, bind=False)
    except EndpointError as exc:
        return f"must be one ZeroMQ endpoint to connect to: {exc}"
    return None


def _kind_ok(value: Any, kind: type | tuple[type, ...]) -> bool:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool):
        return bool in kinds
    if isinstance(value, int) and float in kinds:
        return True
    return isinstance(value, kinds)


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


Schema = Mapping[str, Field]


def validate(schema: Schema, data: Any, where: str) -> dict[str, Any]:
    """Check `data` against `schema`: known keys only, types, ranges; fill defaults."""
    if not isinstance(data, dict):
        raise ProtocolError("bad_request", f"{where} must be a map", where)
    if not data.keys() <= schema.keys():  # the schema's keys are strings
        if not all(isinstance(k, str) for k in data):  # sorted() below needs one key type
            raise ProtocolError("bad_request", f"{where}: field names must be strings", where)
        unknown = sorted(set(data) - set(schema))
        allowed = ", ".join(sorted(schema)) or "none"
        raise ProtocolError("bad_request", f"{where}: unknown field {unknown[0]!r}; allowed: "
                            f"{allowed}", f"{where}.{unknown[0]}")
    out: dict[str, Any] = {}
    for name, spec in schema.items():
        path = f"{where}.{name}"
        if name not in data or data[name] is None:
            if spec.required:
                raise ProtocolError("bad_request", f"{path} is required", path)
            out[name] = spec.default
            continue
        value = data[name]
        if not _kind_ok(value, spec.kind):
            raise ProtocolError("bad_request", f"{path} must be {_kind_name(spec.kind)}, "
                                f"got {type(value).__name__}", path)
        if spec.kind is float:  # an int where a float goes: as a float, or out of range
            try:
                value = float(value)
            except OverflowError:
                raise ProtocolError("bad_request", f"{path} is beyond a float's range",
                                    path) from None
        problem = spec.check(value) if spec.check else None
        if problem:
            raise ProtocolError("bad_request", f"{path} {problem}", path)
        out[name] = value
    return out


EVENT_ID = Field(str, check=matches(UUID_RE, "a lowercase UUID such as "
                                    "'0b7e4f9e-3c1a-4f7e-9a52-1f0c2d3e4b5a'"))
EXPECT_HEAD = Field(int, required=False, check=int_range(0, MAX_SEQ))
SEQ = Field(int, check=int_range(0, MAX_SEQ))
NAME = Field(str, check=str_len(64))
PATH = Field(str, check=str_len(4096))
DIGEST = Field(str, check=matches(SHA256_RE, "64 lowercase hex digits"))

COMMANDS: dict[str, Schema] = {
    "pool.init": {
        "event_id": EVENT_ID, "expect_head": EXPECT_HEAD, "model": PATH,
        "max_loras": Field(int, check=int_range(1, 4096)),
        "max_adapters": Field(int, required=False, default=DEFAULT_MAX_ADAPTERS,
                              check=int_range(1, MAX_MAX_ADAPTERS)),
        "max_rank": Field(int, check=int_range(1, 1024)),
        "targets": Field((str, list), check=_targets),
        "dtype": Field(str, required=False, default="float32", check=one_of(*POOL_DTYPES)),
    },
    "load": {
        "event_id": EVENT_ID, "expect_head": EXPECT_HEAD, "name": NAME, "path": PATH,
        "pin": Field(bool, required=False, default=False),
        "replace": Field(bool, required=False, default=False),
    },
    "unload": {
        "event_id": EVENT_ID, "expect_head": EXPECT_HEAD, "name": NAME,
        "force": Field(bool, required=False, default=False),
    },
    "list": {
        "after": Field(str, required=False, check=str_len(64)),
        "limit": Field(int, required=False, default=MAX_LIST_PAGE,
                       check=int_range(1, MAX_LIST_PAGE)),
    },
    "events": {
        "since": Field(int, required=False, default=0, check=int_range(0, MAX_SEQ)),
        "limit": Field(int, required=False, default=MAX_EVENTS_PER_PAGE,
                       check=int_range(1, MAX_EVENTS_PER_PAGE)),
    },
    "snapshot": {},
    "digest": {"seq": SEQ},
    "blob": {
        "sha256": DIGEST,
        "offset": Field(int, required=False, default=0, check=int_range(0, MAX_SEQ)),
        "length": Field(int, required=False, default=MAX_BLOB_CHUNK,
                        check=int_range(1, MAX_BLOB_CHUNK)),
    },
    "status": {},
    "heartbeat": {
        "id": Field(str, check=matches(ADAPTER_NAME_RE, "a replica id like an adapter name: "
                                       + ADAPTER_NAME_WORDS)),
        "address": Field(str, check=_replica_endpoint),
        "state": Field(str, check=one_of("INITIAL", "SYNCING", "ACTIVE", "REFUSED")),
        "applied_seq": SEQ, "logical_digest": DIGEST,
        "pool_digest": Field(str, check=matches(_POOL_DIGEST_RE, "64 lowercase hex digits, "
                                                "'none' or 'pending'")),
    },
}
WRITE_COMMANDS = frozenset({"pool.init", "load", "unload"})

# The log's identity (docs/protocol.md §9b): null until the log has its genesis event.
LOG_ID = Field(str, required=False, check=matches(UUID_RE, "null or a lowercase UUID"))
# statesvc's heartbeat on the diff stream (topic "hb"); a replica drops one that does not fit.
PUBLISHED_HEARTBEAT: Schema = {
    "head_seq": SEQ, "digest": DIGEST, "ts": Field(float), "log_id": LOG_ID,
}

REQUEST: Schema = {
    "v": Field(int, check=int_range(PROTOCOL_VERSION, PROTOCOL_VERSION)),
    "id": Field(str, check=str_len(64)),
    "cmd": Field(str, check=str_len(64)),
    "args": Field(dict, required=False, default=None),
}


@dataclass(frozen=True)
class Request:
    id: str
    cmd: str
    args: dict[str, Any]


def request_id_of(value: Any) -> str | None:
    """The id of a request that failed validation, when it is a valid one (1 to 64 characters,
    as REQUEST's `id`), for the error reply; None (null) for a missing or invalid id."""
    req_id = value.get("id") if isinstance(value, dict) else None
    return req_id if isinstance(req_id, str) and 0 < len(req_id) <= 64 else None


def decode_request(frame: bytes) -> Request:
    value = unpack(frame)
    env = validate(REQUEST, value, "request")
    if env["cmd"] not in COMMANDS:
        raise ProtocolError("unknown_command", f"unknown command {env['cmd']!r}; known: "
                            f"{', '.join(COMMANDS)}", "request.cmd")
    args = validate(COMMANDS[env["cmd"]], env["args"] or {}, "args")
    return Request(env["id"], env["cmd"], args)


def encode_request(req_id: str, cmd: str, args: Mapping[str, Any]) -> bytes:
    return pack({"v": PROTOCOL_VERSION, "id": req_id, "cmd": cmd, "args": dict(args)})


def ok_reply(req_id: str | None, result: Any) -> bytes:
    return pack({"v": PROTOCOL_VERSION, "id": req_id, "ok": True, "result": result})


def error_reply(req_id: str | None, code: str, message: str, field: str | None = None) -> bytes:
    error: dict[str, Any] = {"code": code, "message": message}
    if field:
        error["field"] = field
    return pack({"v": PROTOCOL_VERSION, "id": req_id, "ok": False, "error": error})


def error_reply_of(req_id: str | None, error: CodedError) -> bytes:
    """The error reply that carries a coded error's code, message and field."""
    return error_reply(req_id, error.code, str(error), error.field)
