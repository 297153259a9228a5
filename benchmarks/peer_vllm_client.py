"""The client of benchmarks/bench_peer_vllm.py, in a process of its own: one streaming

What it runs, and why: docs/benchmarks.md, "peer_vllm_client.py".
"""
from __future__ import annotations

import asyncio
import bisect
import json
import sys
import time
from dataclasses import dataclass
from typing import Any

import uvloop

from benchmarks.gateway_client import Http as _Http
from benchmarks.gateway_client import _Exchange


class _Timed(_Exchange):
    """A keep-alive connection that notes each read's time and the response's length then."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[tuple[float, int]] = []

    def data_received(self, data: bytes) -> None:
        self.reads.append((time.perf_counter(), len(self.buf) + len(data)))
        super().data_received(data)

    async def exchange(self, request: bytes) -> tuple[bytes, float, float]:
        self.reads = []
        return await super().exchange(request)


@dataclass
class Answer:
    """One response as read: its bytes, its reads (time, length so far) and when it was sent."""

    raw: bytes
    reads: list[tuple[float, int]]
    sent: float
    end: float
    tokens: int


def token_times(a: Answer) -> list[float]:
    """When each generated token's event was read (see the module's docstring)."""
    head, _, _ = a.raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    assert b"transfer-encoding: chunked" in head.lower(), head
    body = bytearray()
    chunk_ends: list[tuple[int, int]] = []  # (end in body, end in raw) per chunk
    at = len(head) + 4
    while size := int(a.raw[at:a.raw.index(b"\r\n", at)], 16):
        start = a.raw.index(b"\r\n", at) + 2
        body += a.raw[start:start + size]
        chunk_ends.append((len(body), start + size))
        at = start + size + 2
    body_ends = [b for b, _ in chunk_ends]
    read_ends = [n for _, n in a.reads]
    times, usage, pos = [], None, 0
    while (cut := body.find(b"\n\n", pos)) >= 0:
        event, end = bytes(body[pos:cut]), cut + 2
        pos = end
        if not event.startswith(b"data: {"):
            continue
        c = bisect.bisect_left(body_ends, end)
        raw_end = chunk_ends[c][1] - (chunk_ends[c][0] - end)
        read = a.reads[bisect.bisect_left(read_ends, raw_end)][0]
        obj = json.loads(event[6:])
        if obj.get("choices"):
            choice = obj["choices"][0]
            ids = choice.get("token_ids")
            held = len(ids) if ids is not None else 0 if choice.get("finish_reason") else 1
            times += [read] * held
        elif obj.get("usage"):
            usage = obj["usage"]
    assert body.endswith(b"data: [DONE]\n\n"), bytes(body[-200:])
    assert usage is not None and usage["completion_tokens"] == a.tokens, (usage, a.tokens)
    assert len(times) == a.tokens, (len(times), a.tokens)
    return times


class Http(_Http):
    """Keep-alive HTTP/1.1 connections to one server, one per concurrent stream, each read timed."""

    protocol = _Timed

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        super().__init__(host, int(port))

    async def post(self, body: bytes, tokens: int) -> Answer:
        sent = time.perf_counter()
        conn, raw, _, end = await self.completion(body)
        assert isinstance(conn, _Timed)
        return Answer(raw, conn.reads, sent, end, tokens)


async def run(http: Http, reqs: list[list[Any]], concurrency: int) -> dict[str, Any]:
    answers: list[Answer | None] = [None] * len(reqs)
    todo = iter(range(len(reqs)))

    async def stream() -> None:
        for i in todo:  # a closed loop: the next request once this stream's last one ended
            model, ids, tokens = reqs[i]
            body = json.dumps({"model": model, "prompt": ids, "max_tokens": tokens, "temperature": 0,
                               "ignore_eos": True, "return_token_ids": True, "stream": True,
                               "stream_options": {"include_usage": True}}).encode()
            answers[i] = await http.post(body, tokens)

    t0 = time.perf_counter()
    await asyncio.gather(*(stream() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    ttft, lat, itl = [], [], []
    for a in answers:
        assert a is not None
        times = token_times(a)
        ttft.append(times[0] - a.sent)
        lat.append(a.end - a.sent)
        itl.append([b - x for x, b in zip(times, times[1:])])
    return {"wall_s": wall, "ttft_s": ttft, "lat_s": lat, "itl_s": itl}


async def main_async() -> None:
    servers: dict[str, Http] = {}
    loop = asyncio.get_running_loop()
    try:
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            cmd = json.loads(line)
            http = servers.setdefault(cmd["url"], Http(cmd["url"]))
            cpu = time.process_time()
            got = await run(http, cmd["reqs"], cmd["concurrency"])
            print(json.dumps({**got, "cpu_s": time.process_time() - cpu}), flush=True)
    finally:
        for http in servers.values():
            http.close()


if __name__ == "__main__":
    uvloop.run(main_async())
