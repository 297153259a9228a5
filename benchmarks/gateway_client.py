"""The gateway benchmark's client, in a process of its own (benchmarks/bench_gateway.py).

What it runs, and why: docs/benchmarks.md, "gateway_client.py".
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from typing import Any, cast

import msgpack
import uvloop
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


class _Exchange(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection to the gateway. Each read only appends the bytes
    and notes the time; the response is parsed once it has ended. The client's time counts
    in the added latency (a request's latency less the gateway's upstream time), and the
    32 streams of a round share this process's one event loop as they share the gateway's:
    a stream whose answer ends in a step waits on the client for the other streams' reads
    of that step before it is seen to end, and in a burst that wait is the client's, not the
    gateway's. Reading with little Python per read keeps it small."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.first = 0.0
        self.ended: asyncio.Future[float] | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        self.buf += data
        if not self.first and b"data: {" in self.buf:
            self.first = now
        if self.buf.endswith(b"\r\n0\r\n\r\n") and self.ended is not None \
                and not self.ended.done():
            self.ended.set_result(now)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.ended is not None and not self.ended.done():
            self.ended.set_exception(ConnectionError("the gateway closed the connection"))

    async def exchange(self, request: bytes) -> tuple[bytes, float, float]:
        """The response (headers and chunked body, as sent), when its first event came and
        when it ended (perf_counter)."""
        assert self.transport is not None
        self.buf, self.first = bytearray(), 0.0
        self.ended = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        end = await self.ended
        return bytes(self.buf), self.first, end


class Http:
    """Keep-alive HTTP/1.1 connections to the gateway, one per concurrent request."""

    protocol: type[_Exchange] = _Exchange  # what each connection is (a subclass may time its reads)

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.idle: list[_Exchange] = []

    async def completion(self, body: bytes) -> tuple[_Exchange, bytes, float, float]:
        """POST `body` to /v1/completions on an idle connection, or a new one: the connection
        (back among the idle ones), the raw answer, when its first byte and its end came."""
        request = (b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: "
                   b"application/json\r\nContent-Length: %d\r\n\r\n%s"
                   % (self.host.encode(), len(body), body))
        while self.idle:  # a connection idle past the server's keep-alive timeout is closed
            conn = self.idle.pop()
            if conn.closed:
                continue
            try:
                raw, first, end = await conn.exchange(request)
                break
            except ConnectionError:
                conn.transport.close()  # type: ignore[union-attr]
        else:
            _, conn = await asyncio.get_running_loop().create_connection(self.protocol, self.host, self.port)
            raw, first, end = await conn.exchange(request)
        self.idle.append(conn)
        return conn, raw, first, end

    async def stream(self, body: bytes) -> tuple[int, float, float, float]:
        """POST a streaming completion; the number of `data: {` events, checked to end in
        `data: [DONE]`, when the first one came and when the answer ended (perf_counter),
        and the gateway's `upstream_ms` from the finish chunk."""
        _, raw, first, end = await self.completion(body)
        head, _, chunked = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        assert b"transfer-encoding: chunked" in head.lower(), head
        got = bytearray()
        at = 0
        while size := int(chunked[at:chunked.index(b"\r\n", at)], 16):
            at = chunked.index(b"\r\n", at) + 2
            got += chunked[at:at + size]
            at += size + 2
        assert got.endswith(b"data: [DONE]\n\n"), bytes(got[-200:])
        last = got.rsplit(b"data: ", 2)[1]  # the finish chunk, before `[DONE]`
        finish = json.loads(last)
        return got.count(b"data: {"), first, end, finish["timings"]["upstream_ms"]

    def close(self) -> None:
        for conn in self.idle:
            if conn.transport is not None:
                conn.transport.close()
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
            events, first, end, upstream_ms = await http.stream(body)
            assert events == tokens + 1, events  # one per token, then the finish chunk
            lat[i] = end - t
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
    uvloop.run(main_async(sys.argv[1], sys.argv[2]))  # the gateway's loop too (uvicorn)
