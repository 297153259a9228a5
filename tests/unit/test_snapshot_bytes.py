"""The registry's canonical bytes, assembled from bodies that cache their own (shared/reducer.py),
are byte for byte what packing the whole canonical form gives, after any event, and a snapshot
is still verified against its digest."""
from __future__ import annotations

import pytest

from shared.canonical import canonical_bytes, digest
from shared.events import (AdapterLoaded, AdapterUnloaded, EventError, PoolConfigured, Replaced,
                           lora_scaling)
from shared.reducer import (State, apply, canonical, logical_digest, snapshot_bytes,
                            verified_snapshot)

DIMS = {m: (64, 64) for m in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                              "down_proj")}
POOL = PoolConfigured("f" * 64, {"hidden_size": 64, "rope_scaling": {"type": "linear", "b": [1]}},
                      2, DIMS, 4, 16, ("q_proj", "v_proj"), "float32",
                      "0b9e2d1c-3f4a-4b5c-8d6e-7f8091a2b3c4")


def _loaded(name: str, seq: int, *, pinned: bool = False, replaces: int | None = None,
            alpha: float = 16.0) -> AdapterLoaded:
    rslora = seq % 2 == 0
    return AdapterLoaded(name, seq, f"{seq:064x}", 100 + seq, 8, alpha,
                         lora_scaling(alpha, 8, rslora), rslora,
                         ("q_proj", "v_proj") if seq % 3 else ("v_proj",), pinned,
                         None if replaces is None else Replaced(replaces))


def _states() -> list[State]:
    bodies = [POOL, _loaded("b", 2), _loaded("a", 3, pinned=True), _loaded("c", 4, alpha=7),
              _loaded("b", 5, replaces=2), AdapterUnloaded("c", 4), _loaded("z-long-name", 7)]
    out, state = [State()], State()
    for seq, body in enumerate(bodies, start=1):
        state = apply(state, seq, body)
        out.append(state)
    return out


def test_assembled_bytes_equal_the_packed_canonical_form() -> None:
    for state in _states() + _states():  # the second pass reads the bodies' cached bytes
        assert snapshot_bytes(state) == canonical_bytes(canonical(state))
        assert logical_digest(state) == digest(canonical(state))


def test_a_snapshot_is_verified_against_its_digest() -> None:
    state = _states()[-1]
    data, expected = canonical(state), logical_digest(state)
    assert verified_snapshot(state.seq, data, expected) == state
    tampered = canonical(state)
    tampered["adapters"][0]["sha256"] = "e" * 64
    with pytest.raises(EventError, match="does not match its digest"):
        verified_snapshot(state.seq, tampered, expected)
    with pytest.raises(EventError, match="does not match its digest"):
        verified_snapshot(state.seq, {"pool": None}, expected)  # malformed and not it
    with pytest.raises(EventError, match="malformed"):  # hashes to its digest, does not decode
        verified_snapshot(state.seq, {"pool": None}, digest({"pool": None}))
