"""The gateway benchmark's client, in a process of its own (benchmarks/bench_gateway.py).

It reads one JSON command per line on stdin and answers one JSON line on stdout, so the
measuring process shares neither its interpreter nor its event loop with the requests:

    {"path": "zmq" | "gateway", "reqs": [[adapter, [ids...], tokens], ...], "concurrency": C}
    -> {"wall_s": S, "lat_s": [...], "ttft_s": [...], "over_s": [...], "cpu_s": C}

Both paths stream, run the requests the same way and time them the same way: a closed loop
of `concurrency` streams, each sending the next request of the list as soon as its last one
ended (all of them at once when `concurrency` is the list's length: a burst); each
request's latency from its send to its last byte (the final reply frame; `data: [DONE]`)
and to its first token (the first token frame; the first chunk), listed in the requests'
order; the round from the first send to the last reply. `over_s` is each request's latency less the time its answer took past the
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

    def run(self, reqs: list[list[Any]], concurrency: int
            ) -> tuple[float, list[float], list[float], list[float]]:
        while len(self.socks) < concurrency:
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.address)
            self.socks.append(sock)
        poller = zmq.Poller()
        n = len(reqs)
        sent, lat, ttft, over = [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n
        streamed = [0] * n
        index: dict[str, int] = {}  # request id -> its place in reqs
        todo = iter(range(n))

        def send_next(sock: zmq.Socket[Any]) -> None:
            i = next(todo, None)
            if i is None:
                return
            adapter, ids, tokens = reqs[i]
            rid = uuid.uuid4().hex
            index[rid], sent[i] = i, time.perf_counter()
            sock.send(msgpack.packb({"v": 1, "id": rid, "cmd": "generate", "args": generate_args(
                ids, adapter=adapter, max_new_tokens=tokens, stream=True)}))

        t0 = time.perf_counter()
        for sock in self.socks[:concurrency]:
            send_next(sock)
            poller.register(sock, zmq.POLLIN)
        done = 0
        while done < n:
            ready = poller.poll(300_000)
            assert ready, "no reply from the replica"
            for sock, _ in ready:
                while sock.poll(0):
                    reply = msgpack.unpackb(sock.recv())
                    assert reply["ok"], reply
                    i = index[reply["id"]]
                    if "token" in reply:
                        if not streamed[i]:
                            ttft[i] = time.perf_counter() - sent[i]
                        streamed[i] += 1
                        continue
                    got = len(reply["result"]["output_ids"])
                    assert got == reqs[i][2] == streamed[i], reply
                    lat[i] = time.perf_counter() - sent[i]
                    over[i] = lat[i] - reply["result"]["timings"]["total_ms"] / 1e3
                    done += 1
                    send_next(sock)
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


async def run_gateway(http: Http, reqs: list[list[Any]], concurrency: int
                      ) -> tuple[float, list[float], list[float], list[float]]:
    n = len(reqs)
    lat, ttft, over = [0.0] * n, [0.0] * n, [0.0] * n
    todo = iter(range(n))

    async def stream() -> None:
        for i in todo:  # a closed loop: the next request once this stream's last one ended
            adapter, ids, tokens = reqs[i]
            t = time.perf_counter()
            body = json.dumps({"model": adapter, "prompt": ids, "max_tokens": tokens,
                               "temperature": 0, "stream": True, "ignore_eos": True}).encode()
            events, first, upstream_ms = await http.stream(body)
            assert events == tokens + 1, events  # one per token, then the finish chunk
            lat[i] = time.perf_counter() - t
            ttft[i], over[i] = first - t, lat[i] - upstream_ms / 1e3

    t0 = time.perf_counter()
    await asyncio.gather(*(stream() for _ in range(concurrency)))
    return time.perf_counter() - t0, lat, ttft, over


async def main_async(replica: str, url: str) -> None:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    http, dealers = Http(host, int(port)), Dealers(replica)
    loop = asyncio.get_running_loop()
    try:
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            cmd = json.loads(line)
            cpu = time.process_time()
            if cmd["path"] == "zmq":
                wall, lat, ttft, over = dealers.run(cmd["reqs"], cmd["concurrency"])
            else:
                wall, lat, ttft, over = await run_gateway(http, cmd["reqs"], cmd["concurrency"])
            print(json.dumps({"wall_s": wall, "lat_s": lat, "ttft_s": ttft, "over_s": over,
                              "cpu_s": time.process_time() - cpu}), flush=True)
    finally:
        http.close()
        dealers.close()


if __name__ == "__main__":
    asyncio.run(main_async(sys.argv[1], sys.argv[2]))
