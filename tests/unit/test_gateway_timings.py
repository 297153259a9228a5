"""What the gateway passes on of a replica's `timings` (gateway/service.py
`passed_on`): the protocol's numeric fields and its own upstream_ms, never anything else a
replica (a faulty or spoofed one) puts there; and what it takes of a result's `output_ids`
(`output_ids_of`): a list of token ids in the vocabulary, else a 502 for the request; and that
a token frame outside the vocabulary is never streamed on (the relay in `Gateway.run`)."""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from gateway.errors import ApiError
from gateway.requests import parse_completion
from gateway.routing import FleetView, ReplicaView, Router
from gateway.output import Output
from gateway.service import Gateway, output_ids_of, passed_on
from shared.replica_protocol import Timings
from statesvc.tools.example import ExampleAssets


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


class ScriptedLinks:
    """Stands in for the gateway's ReplicaLinks: each `generate` passes on its script's token
    frames as they would arrive (the frame parser passes any int), then its result."""

    def __init__(self, answers: list[tuple[list[int], dict[str, Any]]]) -> None:
        self.answers = answers

    async def generate(self, address: str, args: dict[str, Any], *, connect_timeout_s: float,
                       timeout_s: float,
                       on_token: Callable[[int, int, dict[str, Any]], None] | None,
                       on_result: Callable[[dict[str, Any]], None] | None) -> dict[str, Any]:
        tokens, result = self.answers.pop(0)
        for t in tokens:
            if on_token is not None:
                on_token(0, t, {"index": 0, "id": t})
        if on_result is not None:
            on_result(result)
        return result


def test_a_token_outside_the_vocabulary_never_reaches_the_client(example: ExampleAssets) -> None:
    """The gateway's relay drops a token frame whose id is outside the vocabulary (a faulty or
    spoofed replica), streamed or watched for stop strings; such ids in the result are a 502,
    and the next request is served."""
    router = Router("tcp://127.0.0.1:1")  # not started: the view is set here
    router.view = FleetView(ok=True, error="", replicas=(
        ReplicaView(id="spoof", address="tcp://127.0.0.1:2", applied_seq=0, queued=0,
                    resident=frozenset(), max_len=64),))
    gw = Gateway(router, example.model_dir, served_name="base", request_timeout_s=10)
    gw.links = ScriptedLinks([  # type: ignore[assignment]
        ([-5, 10**6], {"output_ids": [-5, 10**6]}),
        ([7, -1, 8, 10**6], {"output_ids": [7, 8]}),
        ([9, 2**40, 10], {"output_ids": [9, 10]}),
    ])
    streamed = parse_completion({"model": "base", "prompt": [3, 4], "max_tokens": 4,
                                 "stream": True})
    watched = parse_completion({"model": "base", "prompt": [3, 4], "max_tokens": 4,
                                "stop": ["\x00never"]})

    async def main() -> list[tuple[list[int], Output | ApiError]]:
        got: list[tuple[list[int], Output | ApiError]] = []
        for req, stream in ((streamed, True), (streamed, True), (watched, False)):
            tokens: list[int] = []
            try:
                got.append((tokens, await gw.run(req, on_token=(lambda c, t, _: tokens.append(t)) if stream else None)))
            except ApiError as exc:
                got.append((tokens, exc))
        return got

    (t1, e1), (t2, o2), (t3, o3) = asyncio.run(main())
    assert t1 == [] and isinstance(e1, ApiError)
    assert e1.status == 502 and e1.code == "bad_replica_reply" and "replica spoof" in e1.message
    assert t2 == [7, 8] and isinstance(o2, Output) and o2.text == gw.codec.decode([7, 8])
    assert t3 == [] and isinstance(o3, Output) and o3.ids == [9, 10]
