"""The gateway benchmark's client, in a process of its own (benchmarks/bench_gateway.py).

It reads one JSON command per line on stdin and answers one JSON line on stdout, so the
measuring process shares neither its interpreter nor its event loop with the requests:

    {"path": "zmq" | "gateway", "reqs": [[adapter, [ids...]], ...], "tokens": N}
    -> {"wall_s": S, "lat_s": [...], "ttft_s": [...], "over_s": [...], "cpu_s": C}

Both paths stream and are timed the same way: all requests sent at once, each request's
latency from its send to its last byte (the final reply frame; `data: [DONE]`) and to its
first token (the first token frame; the first chunk), the round from the first send to the
last reply. `over_s` is each request's latency less the time its answer took past the
client's hop: through the gateway, less the gateway's `timings.upstream_ms` (from the
gateway sending it to the replica to its result, in the finish chunk): what the gateway and
its HTTP hop added; on ZeroMQ, less the replica's own `timings.total_ms` (from reading the
request to its result): the ZeroMQ hop and the time in the replica's socket. `cpu_s` is
this process's CPU time over the round.

* zmq: `generate` with `stream: true` (a frame per token, then the result) on one DEALER
  per concurrent request (kept across rounds), every token frame read and counted;
* gateway: `/v1/completions` with `stream: true` over keep-alive HTTP/1.1 connections (one
  per concurrent request, kept across rounds), read by a small chunked-transfer reader that
  counts `data:` events. Not httpx: on 2 shared CPUs httpx's per-chunk Python would be
  charged to the gateway; a client on its own machine pays its own parsing. The openai
  client is what the tests use (tests/integration/test_gateway.py).
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from typing import Any

import msgpack
import zmq

from shared.replica_protocol import generate_args


class Dealers:
    """One DEALER per concurrent request, kept across rounds: a replica holds only a few
    unread replies per connection (docs/protocol.md §13b), so streams do not share one,
    as the gateway's do not."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.socks: list[zmq.Socket[Any]] = []

    def run(self, reqs: list[list[Any]], tokens: int
            ) -> tuple[float, list[float], list[float], list[float]]:
        while len(self.socks) < len(reqs):
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.address)
            self.socks.append(sock)
        poller = zmq.Poller()
        sent: dict[str, float] = {}
        streamed: dict[str, int] = {}
        lat: list[float] = []
        ttft: list[float] = []
        over: list[float] = []
        t0 = time.perf_counter()
        for sock, (adapter, ids) in zip(self.socks, reqs):
            rid = uuid.uuid4().hex
            sent[rid], streamed[rid] = time.perf_counter(), 0
            sock.send(msgpack.packb({"v": 1, "id": rid, "cmd": "generate", "args": generate_args(
                ids, adapter=adapter, max_new_tokens=tokens, stream=True)}))
            poller.register(sock, zmq.POLLIN)
        while len(lat) < len(reqs):
            ready = poller.poll(300_000)
            assert ready, "no reply from the replica"
            for sock, _ in ready:
                while sock.poll(0):
                    reply = msgpack.unpackb(sock.recv())
                    assert reply["ok"], reply
                    if "token" in reply:
                        if not streamed[reply["id"]]:
                            ttft.append(time.perf_counter() - sent[reply["id"]])
                        streamed[reply["id"]] += 1
                        continue
                    got = len(reply["result"]["output_ids"])
                    assert got == tokens == streamed[reply["id"]], reply
                    lat.append(time.perf_counter() - sent[reply["id"]])
                    over.append(lat[-1] - reply["result"]["timings"]["total_ms"] / 1e3)
        return time.perf_counter() - t0, lat, ttft, over

    def close(self) -> None:
        for sock in self.socks:
            sock.close(0)


class Http:
    """Keep-alive HTTP/1.1 connections to the gateway, one per concurrent request."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def stream(self, body: bytes) -> tuple[int, float, float]:
        """POST a streaming completion; the number of `data: {` events, checked to end in
        `data: [DONE]`, when the first one came (perf_counter), and the gateway's
        `upstream_ms` from the finish chunk."""
        request = (b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: "
                   b"application/json\r\nContent-Length: %d\r\n\r\n%s"
                   % (self.host.encode(), len(body), body))
        while self.idle:  # a connection idle past the server's keep-alive timeout is closed
            reader, writer = self.idle.pop()
            writer.write(request)
            try:
                head = await reader.readuntil(b"\r\n\r\n")
                break
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()
        else:
            reader, writer = await asyncio.open_connection(self.host, self.port)
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        assert b"transfer-encoding: chunked" in head.lower(), head
        got = bytearray()
        first = 0.0
        while size := int((await reader.readuntil(b"\r\n"))[:-2], 16):
            got += (await reader.readexactly(size + 2))[:-2]
            first = first or time.perf_counter()
        await reader.readexactly(2)  # the last chunk's CRLF
        assert got.endswith(b"data: [DONE]\n\n"), bytes(got[-200:])
        self.idle.append((reader, writer))
        last = got.rsplit(b"data: ", 2)[1]  # the finish chunk, before `[DONE]`
        finish = json.loads(last)
        return got.count(b"data: {"), first, finish["timings"]["upstream_ms"]

    def close(self) -> None:
        for _, writer in self.idle:
            writer.close()
        self.idle = []


async def run_gateway(http: Http, reqs: list[list[Any]], tokens: int
                      ) -> tuple[float, list[float], list[float], list[float]]:
    async def one(adapter: str, ids: list[int]) -> tuple[float, float, float]:
        t = time.perf_counter()
        body = json.dumps({"model": adapter, "prompt": ids, "max_tokens": tokens,
                           "temperature": 0, "stream": True, "ignore_eos": True}).encode()
        events, first, upstream_ms = await http.stream(body)
        assert events == tokens + 1, events  # one per token, then the finish chunk
        lat = time.perf_counter() - t
        return lat, first - t, lat - upstream_ms / 1e3

    t0 = time.perf_counter()
    got = await asyncio.gather(*(one(a, ids) for a, ids in reqs))
    return (time.perf_counter() - t0, [g[0] for g in got], [g[1] for g in got],
            [g[2] for g in got])


async def main_async(replica: str, url: str) -> None:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    http, dealers = Http(host, int(port)), Dealers(replica)
    loop = asyncio.get_running_loop()
    try:
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            cmd = json.loads(line)
            cpu = time.process_time()
            if cmd["path"] == "zmq":
                wall, lat, ttft, over = dealers.run(cmd["reqs"], cmd["tokens"])
            else:
                wall, lat, ttft, over = await run_gateway(http, cmd["reqs"], cmd["tokens"])
            print(json.dumps({"wall_s": wall, "lat_s": lat, "ttft_s": ttft, "over_s": over,
                              "cpu_s": time.process_time() - cpu}), flush=True)
    finally:
        http.close()
        dealers.close()


if __name__ == "__main__":
    asyncio.run(main_async(sys.argv[1], sys.argv[2]))
