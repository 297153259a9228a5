"""Canonical msgpack: one byte string per value, so digests are reproducible."""
from __future__ import annotations

import hashlib
from typing import Any

import msgpack


_SCALARS = frozenset((type(None), bool, int, float, str, bytes))


def _sorted(value: Any) -> Any:
    """`value` with every map's keys in order and tuples as lists (scalars are passed over in
    their container's loop: a registry holds a million of them)."""
    if isinstance(value, dict):
        return {k: v if type(v := value[k]) in _SCALARS else _sorted(v) for k in sorted(value)}
    if isinstance(value, (list, tuple)):
        return [v if type(v) in _SCALARS else _sorted(v) for v in value]
    return value


def canonical_bytes(value: Any) -> bytes:
    """msgpack of `value` with map keys sorted and tuples packed as arrays."""
    packed: bytes = msgpack.packb(_sorted(value), use_bin_type=True)
    return packed


def digest(value: Any) -> str:
    """sha256 hex of the canonical msgpack of `value`."""
    return hashlib.sha256(canonical_bytes(value)).hexdigest()
