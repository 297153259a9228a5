"""Cancelling a request: the replica's `cancel` (docs/protocol.md §13b) frees the request's row
at once and touches nothing else, and an HTTP client that leaves a stream makes the gateway
cancel its request on the replica, streamed or not; a replica whose queue is full gives the
gateway's client OpenAI's 429. Real statesvc, one replica whose steps are slowed (a
test-only fault switch, so a request is still running when it is cancelled) with one row
and room for one more request in its queue, and a real gateway, all subprocesses."""
from __future__ import annotations

import json
import socket
import threading
from typing import Any, Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared.faults import SLOW_STEP_ENV
from shared.protocol import encode_request, unpack
from shared.replica_protocol import generate_args
from statesvc.tools.example import ExampleAssets
from testkit.fleet import Computed, Gateway, wait_for
from tests.helpers import Fleet, dealer

pytestmark = pytest.mark.timeout(300)
N = 200  # new tokens: 10 s at the replica's slowed 50 ms a step, far longer than any test


class Setup:
    def __init__(self, fleet: Fleet, replica: Computed, gateway: Gateway) -> None:
        self.fleet, self.replica, self.gateway = fleet, replica, gateway

    def inference(self) -> dict[str, Any]:
        return dict(self.replica.status()["inference"])


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, example: ExampleAssets) -> Iterator[Setup]:
    tmp = tmp_path_factory.mktemp("cancel")
    fleet = Fleet(tmp, example)
    try:
        replica = fleet.serving({"chat": "attn-qv-r8"}, env={SLOW_STEP_ENV: "0.05"},
                                args=("--no-warmup", "--max-batch", "1", "--queue-limit", "1"))
        yield Setup(fleet, replica, fleet.gateway())
    finally:
        fleet.stop()


def test_cancel_frees_the_row_and_only_the_sender_may(setup: Setup) -> None:
    head = setup.fleet.head()
    before = setup.inference()["cancelled"]
    owner, stranger = (dealer(setup.replica.listen, timeout_ms=120_000) for _ in range(2))
    try:
        owner.send(encode_request("g1", "generate", generate_args(
            [5, 6, 7], adapter="chat", max_new_tokens=N, stream=True)))
        first = unpack(owner.recv())
        assert first["token"]["index"] == 0
        assert setup.inference()["running"] == 1
        # another connection cannot cancel it: the request runs on
        stranger.send(encode_request("c0", "cancel", {"id": "g1"}))
        assert unpack(stranger.recv()) == {"v": 1, "id": "c0", "ok": True,
                                           "result": {"cancelled": False}}
        owner.send(encode_request("c1", "cancel", {"id": "g1"}))
        frames = []
        while not frames or frames[-1]["id"] != "c1":
            frames.append(unpack(owner.recv()))
        tokens, (final, reply) = frames[:-2], frames[-2:]
        assert all("token" in f for f in tokens) and len(tokens) < N - 1
        assert final["id"] == "g1" and not final["ok"]
        assert final["error"]["code"] == "cancelled"
        assert reply["result"] == {"cancelled": True}
        inference = setup.inference()
        assert inference["running"] == 0 and inference["waiting"] == 0
        assert inference["cancelled"] == before + 1
        # a cancel for what is gone, and a bad one, change nothing
        owner.send(encode_request("c2", "cancel", {"id": "g1"}))
        assert unpack(owner.recv())["result"] == {"cancelled": False}
        owner.send(encode_request("c3", "cancel", {"id": 7}))
        bad = unpack(owner.recv())
        assert not bad["ok"] and bad["error"]["code"] == "bad_request", bad
        # the freed row serves the next request whole
        owner.send(encode_request("g2", "generate", generate_args([5, 6, 7], max_new_tokens=4)))
        assert len(unpack(owner.recv())["result"]["output_ids"]) == 4
    finally:
        owner.close(0)
        stranger.close(0)
    assert setup.fleet.head() == head  # the log is untouched
    assert setup.inference()["cancelled"] == before + 1


def gone_count(gateway: Gateway) -> float:
    text = httpx.get(gateway.url + "/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text)
               for s in f.samples if s.name == "loraplane_gateway_requests_total"
               and s.labels["status"] == "499")


def cancelled_once(setup: Setup, before: int, gone: float, head: int) -> None:
    """The replica cancelled one more request and runs none, the gateway counted one more
    499, and the log is untouched."""
    wait_for(lambda: setup.inference()["cancelled"] == before + 1,
             what="the replica to cancel the request")
    assert setup.inference()["running"] == 0
    wait_for(lambda: gone_count(setup.gateway) == gone + 1, what="the gateway to count it")
    assert setup.fleet.head() == head


def test_a_client_that_leaves_a_stream_cancels_its_request(setup: Setup) -> None:
    head = setup.fleet.head()
    before = setup.inference()["cancelled"]
    gone = gone_count(setup.gateway)
    body = {"model": "chat", "prompt": [5, 6, 7], "max_tokens": N, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=setup.gateway.url, timeout=120) as client:
        with client.stream("POST", "/v1/completions", json=body) as res:
            assert res.status_code == 200
            lines = res.iter_lines()
            assert next(lines).startswith("data: {")  # the first token's chunk
        # leaving the block closed the connection mid-stream
    cancelled_once(setup, before, gone, head)
    # the gateway serves on
    res = httpx.post(setup.gateway.url + "/v1/completions", timeout=120, json={
        **body, "stream": False, "max_tokens": 3})
    assert res.status_code == 200 and res.json()["usage"]["completion_tokens"] == 3


def test_a_client_that_leaves_before_an_unstreamed_answer_cancels_its_request(
        setup: Setup) -> None:
    head = setup.fleet.head()
    before = setup.inference()["cancelled"]
    gone = gone_count(setup.gateway)
    body = json.dumps({"model": "chat", "prompt": [5, 6, 7], "max_tokens": N,
                       "temperature": 0, "ignore_eos": True}).encode()
    host, port = setup.gateway.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (host.encode(), len(body), body))
        wait_for(lambda: setup.inference()["running"] == 1, what="the request to run")
    # the connection closed with no answer read
    cancelled_once(setup, before, gone, head)
    # an unstreamed answer that runs to its end carries the replica's own timings
    res = httpx.post(setup.gateway.url + "/v1/completions", timeout=120, json={
        "model": "chat", "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0})
    assert res.status_code == 200, res.text
    timings = res.json()["timings"]
    assert set(timings) == {"queue_ms", "prefill_ms", "decode_ms", "total_ms",
                            "residency_ms", "upstream_ms"}
    assert 0 < timings["prefill_ms"] < timings["total_ms"] < timings["upstream_ms"]


def test_an_overloaded_replica_is_openais_429_and_changes_nothing(setup: Setup) -> None:
    """One request runs (the replica's one row), one waits (its queue of one), and the next is
    refused by the replica as `overloaded`: the only replica, so the gateway answers 429 in
    OpenAI's shape, which the official client raises as RateLimitError. The running and the
    waiting requests are untouched, and the log too."""
    head = setup.fleet.head()
    client = openai.OpenAI(base_url=setup.gateway.url + "/v1", api_key="unused",
                           max_retries=0, timeout=120)  # the client retries a 429 by default
    body = {"model": "chat", "prompt": [5, 6, 7], "max_tokens": N, "temperature": 0,
            "stream": True, "ignore_eos": True}
    waited: list[Any] = []
    with httpx.Client(base_url=setup.gateway.url, timeout=120) as http:
        with http.stream("POST", "/v1/completions", json=body) as running:
            assert running.status_code == 200
            lines = running.iter_lines()  # kept: a dropped iterator closes the response
            assert next(lines).startswith("data: {")  # it holds the row
            waiter = threading.Thread(target=lambda: waited.append(client.completions.create(
                model="chat", prompt=[5, 6, 7], max_tokens=3, temperature=0)))
            waiter.start()
            try:
                wait_for(lambda: setup.inference()["waiting"] == 1, what="a request waiting")
                with pytest.raises(openai.RateLimitError) as refused:
                    client.completions.create(model="chat", prompt=[5, 6, 7], max_tokens=3,
                                              temperature=0)
                assert refused.value.status_code == 429 and refused.value.code == "overloaded"
                error = refused.value.response.json()["error"]
                assert set(error) >= {"message", "type", "code"} and "queued" in error["message"]
                assert setup.inference()["running"] == 1 and setup.inference()["waiting"] == 1
            finally:
                running.close()  # leaving the stream cancels it: the waiting request runs
                waiter.join(120)
    assert not waiter.is_alive() and len(waited) == 1
    assert waited[0].usage.completion_tokens == 3
    assert setup.fleet.head() == head
    assert httpx.get(setup.gateway.url + "/health").status_code == 200
