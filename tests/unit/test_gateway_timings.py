"""What the gateway passes on of a replica's `timings` (computed/gateway/service.py
`passed_on`): the protocol's numeric fields and its own upstream_ms, never anything else a
replica (a faulty or spoofed one) puts there; and what it takes of a result's `output_ids`
(`output_ids_of`): a list of token ids in the vocabulary, else a 502 for the request."""
from __future__ import annotations

import pytest

from computed.gateway.requests import ApiError
from computed.gateway.service import output_ids_of, passed_on
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


def test_a_result_without_token_ids_in_the_vocabulary_is_a_502() -> None:
    assert output_ids_of({"output_ids": [0, 5, 511]}, 512, "r1") == [0, 5, 511]
    assert output_ids_of({"output_ids": []}, 512, "r1") == []
    for bad in ({}, {"output_ids": None}, {"output_ids": "abc"}, {"output_ids": [1, 512]},
                {"output_ids": [-1]}, {"output_ids": [1.0]}, {"output_ids": [True]},
                {"output_ids": {"0": 1}}):
        with pytest.raises(ApiError) as err:
            output_ids_of(bad, 512, "r1")
        assert err.value.status == 502 and err.value.code == "bad_replica_reply"
        assert "replica r1" in err.value.message and "[0, 512)" in err.value.message
