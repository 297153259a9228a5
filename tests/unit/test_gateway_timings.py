"""What the gateway passes on of a replica's `timings` (computed/gateway/service.py
`passed_on`): the protocol's numeric fields and its own upstream_ms, never anything else a
replica (a faulty or spoofed one) puts there."""
from __future__ import annotations

from computed.gateway.service import passed_on
from shared.replica_protocol import Timings


def test_known_numeric_fields_pass_with_upstream_ms() -> None:
    sent = {k: float(i + 1) for i, k in enumerate(sorted(Timings.__required_keys__))}
    assert passed_on({"timings": sent}, 0.25) == {**sent, "upstream_ms": 250.0}


def test_anything_else_a_replica_sends_is_dropped() -> None:
    hostile = {"total_ms": "<script>", "queue_ms": {"nested": [1] * 1000}, "decode_ms": True,
               "prefill_ms": 3, "evil": 1.0, "residency_ms": None}
    assert passed_on({"timings": hostile}, 0.001) == {"prefill_ms": 3.0, "upstream_ms": 1.0}
    for bad in ([1, 2], "x", 7, None):
        assert passed_on({"timings": bad}, 0.5) is None
    assert passed_on({}, 0.5) is None  # ended early by the gateway: no result's timings
