"""`computed gateway --auth TOKENS`: bearer tokens mapped to statesvc operator identities.

TOKENS is a JSON file `{"NAME": {"token_sha256": HEX, "key": PATH}, ...}`: the SHA-256 of each
operator's bearer token (the token itself is never stored, logged or echoed) and that
operator's CURVE secret key file (`loractl keys new NAME`; a relative PATH is beside TOKENS).
A caller of the load and unload endpoints presents `Authorization: Bearer TOKEN`; the
gateway appends the event over the operator's own CURVE key, so statesvc records
`operator:NAME` as its actor, as for `loractl` with that key.
"""
from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from pathlib import Path

from gateway.errors import ApiError
from shared.client import ControlClient, RemoteError, Unavailable, new_event_id
from shared.config import MAX_SEQ
from shared.keys import ClientKeys, KeyError_, client_keys

MAX_TOKENS_FILE_BYTES = 1 << 20


@dataclass(frozen=True)
class Operator:
    name: str
    digest: bytes  # sha256 of the token
    keys: ClientKeys


def load_operators(path: Path, server_key: str | None) -> list[Operator]:
    """The operators of a tokens file; ValueError saying what is wrong with it."""
    if server_key is None:
        raise ValueError("--auth needs --server-key (statesvc's server.key): the gateway "
                         "appends each operator's events over that operator's CURVE key")
    if not path.is_file() or path.stat().st_size > MAX_TOKENS_FILE_BYTES:
        raise ValueError(f"{path}: not a file of at most {MAX_TOKENS_FILE_BYTES} bytes")
    try:
        entries = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path} is not JSON: {exc}") from None
    if not isinstance(entries, dict) or not entries:
        raise ValueError(f"{path} must map operator names to {{token_sha256, key}}")
    out = []
    for name, e in entries.items():
        digest = e.get("token_sha256") if isinstance(e, dict) else None
        key = e.get("key") if isinstance(e, dict) else None
        try:
            raw = bytes.fromhex(digest) if isinstance(digest, str) else b""
        except ValueError:
            raw = b""
        if len(raw) != 32 or not isinstance(key, str):
            raise ValueError(f"{path}: {name!r} needs token_sha256 (64 hex digits: "
                             f"`printf %s TOKEN | sha256sum`) and key (its *.key_secret)")
        try:
            keys = client_keys(str(path.parent / key), server_key)
        except KeyError_ as exc:
            raise ValueError(f"{path}: {name!r}: {exc}") from None
        assert keys is not None
        out.append(Operator(name, raw, keys))
    return out


def operator_of(operators: list[Operator], authorization: str | None) -> Operator:
    """The operator whose token the Authorization header carries; 401 otherwise."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(401, "this endpoint needs an operator's token: Authorization: Bearer "
                       "TOKEN", code="invalid_api_key")
    digest = hashlib.sha256(token.strip().encode("utf-8", "replace")).digest()
    found = None
    for op in operators:  # compare with every entry, in constant time each
        if hmac.compare_digest(op.digest, digest):
            found = op
    if found is None:
        raise ApiError(401, "the bearer token is not an operator's", code="invalid_api_key")
    return found


OPERATOR_KEY_WITHOUT_AUTH = (
    "--key is an operator key of statesvc (its public key is in statesvc's operators/): "
    "without --auth, anyone who reaches the gateway could load and unload adapters as that "
    "operator. Give the gateway a key of its own in statesvc's replicas/ (reads only), or "
    "start it with --auth TOKENS so that each caller acts as its own operator")


def may_change_log(state: str, keys: ClientKeys, *, timeout_s: float = 3.0) -> bool | None:
    """Whether `keys` may append to statesvc's log (an operator key), asked of statesvc with
    an `unload` that cannot succeed: well formed (statesvc checks a request's fields before the
    caller's role), but of no adapter (`-` is no adapter's name) and expecting a head the log never reaches, so an
    operator's is refused by the command (a conflict or a bad name), anyone else's as
    `forbidden`, and nothing is appended either way. None when statesvc does not answer."""
    try:
        with ControlClient(state, timeout_s=timeout_s, retries=1, keys=keys) as c:
            c.call("unload", {"event_id": new_event_id(), "name": "-", "expect_head": MAX_SEQ})
    except Unavailable:
        return None
    except RemoteError as exc:
        return exc.code != "forbidden"
    return True  # an unload without a name cannot succeed; a statesvc that says it did
