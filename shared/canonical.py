"""Canonical msgpack: one byte string per value, so digests are reproducible."""
from __future__ import annotations

import hashlib
from typing import Any

import msgpack


def _sorted(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _sorted(value[k]) for k in sorted(value)}
    if isinstance(value, (list, tuple)):
        return [_sorted(v) for v in value]
    return value


def canonical_bytes(value: Any) -> bytes:
    """msgpack of `value` with map keys sorted and tuples packed as arrays."""
    packed: bytes = msgpack.packb(_sorted(value), use_bin_type=True)
    return packed


def digest(value: Any) -> str:
    """sha256 hex of the canonical msgpack of `value`."""
    return hashlib.sha256(canonical_bytes(value)).hexdigest()
