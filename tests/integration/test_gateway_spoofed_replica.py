"""A faulty or spoofed replica behind the gateway (computed/gateway/service.py): a token frame
whose id is outside the vocabulary is never passed on, and a result without valid
`output_ids` is a 502 `bad_replica_reply` for that request, while the gateway serves the
next request. The replica is a real ZeroMQ ROUTER on loopback that answers `generate` as
it is told; the gateway's Gateway runs in process on a real event loop and tokenizer."""
from __future__ import annotations

import asyncio
import threading
from typing import Any

import msgpack
import zmq

from computed.gateway.requests import ApiError, parse_completion
from computed.gateway.routing import FleetView, ReplicaView, Router
from computed.gateway.service import Gateway
from shared.protocol import ok_reply, pack
from statesvc.tools.example import ExampleAssets


def _replica(bound: list[str], answers: list[tuple[list[Any], Any]], ready: threading.Event,
             stop: threading.Event) -> None:
    """Answers each `generate`, in order, with (token ids as frames, output_ids); its
    address (a port the OS picked: no other test can hold it) goes to `bound`."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    bound.append(f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}")
    ready.set()
    try:
        for tokens, output_ids in answers:
            while not sock.poll(100):
                if stop.is_set():
                    return
            who, frame = sock.recv_multipart()
            req = msgpack.unpackb(frame)
            for i, t in enumerate(tokens):
                sock.send_multipart([who, pack({"v": 1, "id": req["id"], "ok": True,
                                                "token": {"index": i, "id": t}})])
            sock.send_multipart([who, ok_reply(req["id"], {"output_ids": output_ids})])
    finally:
        sock.close(0)


def test_a_spoofed_replicas_tokens_and_result_never_reach_the_client(
        example: ExampleAssets) -> None:
    answers: list[tuple[list[Any], Any]] = [
        ([-5, 10**6], [-5, 10**6]),  # ids outside the vocabulary
        ([7], {"not": "a list"}),  # a result that is no list of ids
        ([7, 8], [7, 8]),  # an honest answer: served
    ]
    bound: list[str] = []
    ready, stop = threading.Event(), threading.Event()
    fake = threading.Thread(target=_replica, args=(bound, answers, ready, stop), daemon=True)
    fake.start()
    assert ready.wait(10), "the stand-in replica did not bind"  # before the gateway connects
    address = bound[0]
    router = Router("tcp://127.0.0.1:1")  # not started: the view is set below
    router.view = FleetView(ok=True, error="", replicas=(
        ReplicaView(id="spoof", address=address, applied_seq=0, queued=0,
                    resident=frozenset(), max_len=64),))
    gw = Gateway(router, example.model_dir, served_name="base", request_timeout_s=10)
    req = parse_completion({"model": "base", "prompt": [3, 4], "max_tokens": 2,
                            "stream": True})

    async def main() -> list[tuple[list[int], ApiError | str]]:
        got = []
        for _ in answers:
            tokens: list[int] = []
            try:
                out = await gw.run(req, on_token=tokens.append)
                got.append((tokens, out.text))
            except ApiError as exc:
                got.append((tokens, exc))
        return got

    try:
        got = asyncio.run(main())
    finally:
        stop.set()
        fake.join(5)
    (t1, e1), (t2, e2), (t3, text) = got
    assert t1 == []  # neither out-of-vocabulary id was passed on
    for err in (e1, e2):
        assert isinstance(err, ApiError) and err.status == 502
        assert err.code == "bad_replica_reply" and "replica spoof" in err.message
    assert t2 == [7]
    assert t3 == [7, 8] and text == gw.codec.decode([7, 8])
