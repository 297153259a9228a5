"""The OpenAI-compatible gateway against ZeroMQ straight to the replica, side by side in one run.

A real `statesvc serve`, one `computed serve --max-batch 32` (warmed up) and `computed
gateway` (shared/fleet.py subprocesses) on the example model (statesvc/tools/example.py's
ModelShape: vocab 512, hidden 64, 2 layers: a tiny model, so per-token compute is small and
the gateway's share of the time is as large as it gets) with 16 rank-8 adapters, all
resident (`max_loras` 16). One round sends the same mixed-adapter workload both ways, order
alternating by round:

* zmq: 32 `generate` requests (adapter i % 16, 8 random prompt tokens, `--tokens` new
  tokens) sent at once on one DEALER, replies gathered;
* gateway: the same 32 as `/v1/completions` with `stream: true` (prompt as token ids,
  `ignore_eos`), 32 concurrent httpx streams read to `data: [DONE]`.

Per round: throughput (32 x tokens / wall seconds), each request's latency (send to last
reply byte); reported: medians over rounds of the throughput ratio gateway / zmq (target
>= 0.9x) and of the added latency, the gateway's p50 (p99) latency minus zmq's p50 (p99)
(target p50 under 2 ms). In `make bench` (benchmarks/suite.py); the replicas stream their
tokens (docs/protocol.md §13b), so the gateway relays each as it comes.

    .venv/bin/python -m benchmarks.bench_gateway [--rounds 5] [--tokens 32] [--quick] [--no-write]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import msgpack
import numpy as np
import zmq

from benchmarks.report import publish
from shared.client import ControlClient, new_event_id
from shared.fleet import Computed, Gateway, StateSvc, wait_for
from shared.replica_protocol import generate_args
from statesvc.tools.example import AdapterSpec, make_example

BATCH, ADAPTERS, PROMPT = 32, 16, 8


def cpu_name() -> str:
    names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
             if line.startswith("model name")] if Path("/proc/cpuinfo").exists() else []
    return f"{names[0] if names else platform.machine()}, {os.cpu_count()} CPUs"


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


def workload(vocab: int, seed: int) -> list[tuple[str, list[int]]]:
    rng = np.random.default_rng(seed)
    return [(f"a{i % ADAPTERS:02d}", [int(t) for t in rng.integers(3, vocab, PROMPT)])
            for i in range(BATCH)]


def run_zmq(address: str, reqs: list[tuple[str, list[int]]], tokens: int) -> tuple[float, list[float]]:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    sent: dict[str, float] = {}
    lat: list[float] = []
    try:
        t0 = time.perf_counter()
        for adapter, ids in reqs:
            rid = uuid.uuid4().hex
            sent[rid] = time.perf_counter()
            sock.send(msgpack.packb({"v": 1, "id": rid, "cmd": "generate", "args": generate_args(
                ids, adapter=adapter, max_new_tokens=tokens)}))
        while len(lat) < len(reqs):
            assert sock.poll(120_000), "no reply from the replica"
            reply = msgpack.unpackb(sock.recv())
            assert reply["ok"] and len(reply["result"]["output_ids"]) == tokens, reply
            lat.append(time.perf_counter() - sent[reply["id"]])
        return time.perf_counter() - t0, lat
    finally:
        sock.close(0)


async def _gateway(url: str, reqs: list[tuple[str, list[int]]],
                   tokens: int) -> tuple[float, list[float]]:
    limits = httpx.Limits(max_connections=BATCH, max_keepalive_connections=BATCH)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        async def one(adapter: str, ids: list[int]) -> float:
            t = time.perf_counter()
            chunks = 0
            async with client.stream("POST", "/v1/completions", json={
                    "model": adapter, "prompt": ids, "max_tokens": tokens, "temperature": 0,
                    "stream": True, "ignore_eos": True}) as res:
                assert res.status_code == 200, await res.aread()
                async for line in res.aiter_lines():
                    chunks += line.startswith("data: {")
            assert chunks == tokens + 1, chunks  # one per token, then the finish chunk
            return time.perf_counter() - t

        t0 = time.perf_counter()
        lat = await asyncio.gather(*(one(a, ids) for a, ids in reqs))
        return time.perf_counter() - t0, list(lat)


def run_gateway(url: str, reqs: list[tuple[str, list[int]]], tokens: int) -> tuple[float, list[float]]:
    return asyncio.run(_gateway(url, reqs, tokens))


def measure(rounds: int, tokens: int) -> dict[str, Any]:
    load_before = os.getloadavg()[0]
    root = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    specs = tuple(AdapterSpec(f"a{i:02d}", r=8, lora_alpha=16, target_modules=("q_proj", "v_proj"))
                  for i in range(ADAPTERS))
    ex = make_example(root / "example", adapters=specs)
    svc = StateSvc(root / "data")
    replica = Computed(ex.model_dir, svc, root / "replicas" / "r1", replica_id="r1",
                       extra_args=("--max-batch", str(BATCH)))
    gateway = Gateway(ex.model_dir, svc, log_file=root / "gateway.log",
                      extra_args=("--max-pending", str(4 * BATCH)))
    try:
        svc.start()
        with ControlClient(svc.control) as c:
            c.call("pool.init", {"event_id": new_event_id(), "model": str(ex.model_dir),
                                 "max_loras": ADAPTERS, "max_rank": 8, "targets": "all"})
            for s in specs:
                c.call("load", {"event_id": new_event_id(), "name": s.name,
                                "path": str(ex.adapter_dirs[s.name])})
        replica.start()
        gateway.start()
        wait_for(lambda: httpx.get(gateway.url + "/health").status_code == 200,
                 what="gateway healthy")
        rows = []
        for r in range(rounds + 1):  # round 0 warms both paths (slot fills, connections)
            reqs = workload(ex.shape.vocab_size, r)
            order = ["zmq", "gateway"] if r % 2 else ["gateway", "zmq"]
            got = {m: (run_zmq(replica.listen, reqs, tokens) if m == "zmq"
                       else run_gateway(gateway.url, reqs, tokens)) for m in order}
            if r:
                rows.append({m: {"wall_s": w, "tok_s": BATCH * tokens / w,
                                 "p50_ms": 1e3 * pct(lat, 50), "p99_ms": 1e3 * pct(lat, 99)}
                             for m, (w, lat) in got.items()})
    finally:
        gateway.stop()
        replica.stop()
        svc.stop()
    med = statistics.median
    return {
        "cpu": cpu_name(), "load_average": {"before": load_before, "after": os.getloadavg()[0]},
        "rounds": rounds, "batch": BATCH,
        "adapters": ADAPTERS, "prompt_tokens": PROMPT, "new_tokens": tokens,
        "model": {"vocab_size": ex.shape.vocab_size, "hidden_size": ex.shape.hidden_size,
                  "layers": ex.shape.num_hidden_layers},
        "rounds_detail": rows,
        "zmq_tok_s": med(r["zmq"]["tok_s"] for r in rows),
        "gateway_tok_s": med(r["gateway"]["tok_s"] for r in rows),
        "ratio": med(r["gateway"]["tok_s"] / r["zmq"]["tok_s"] for r in rows),
        "ratio_range": [min(r["gateway"]["tok_s"] / r["zmq"]["tok_s"] for r in rows),
                        max(r["gateway"]["tok_s"] / r["zmq"]["tok_s"] for r in rows)],
        "added_p50_ms": med(r["gateway"]["p50_ms"] - r["zmq"]["p50_ms"] for r in rows),
        "added_p99_ms": med(r["gateway"]["p99_ms"] - r["zmq"]["p99_ms"] for r in rows),
    }


def report(res: dict[str, Any]) -> str:
    """The README's bench:gateway section."""
    m, lo, hi = res["model"], *res["ratio_range"]
    return "\n".join([
        "| path | tokens/s | gateway / ZeroMQ (spread) | added latency p50 | added p99 |",
        "|---|---:|---:|---:|---:|",
        f"| ZeroMQ straight to the replica | {res['zmq_tok_s']:,.0f} | | | |",
        f"| gateway, streaming SSE | {res['gateway_tok_s']:,.0f} | {res['ratio']:.2f}x "
        f"({lo:.2f}-{hi:.2f}); target >= 0.9x: {'PASS' if res['ratio'] >= 0.9 else 'MISS'} | "
        f"{res['added_p50_ms']:+.1f} ms; target < 2 ms: "
        f"{'PASS' if res['added_p50_ms'] < 2 else 'MISS'} | {res['added_p99_ms']:+.1f} ms |",
        "",
        f"Batch {res['batch']} over {res['adapters']} resident rank-8 adapters, "
        f"{res['prompt_tokens']} prompt tokens and {res['new_tokens']} new tokens each, sent "
        f"by ZeroMQ straight to one replica and as {res['batch']} concurrent streaming "
        f"`/v1/completions` through the gateway (httpx, in the benchmark's process), rounds "
        f"alternating which goes first; the example model (vocab {m['vocab_size']}, hidden "
        f"{m['hidden_size']}, {m['layers']} layers); {res['rounds']} rounds, medians; on "
        f"{res['cpu']}, load average {res['load_average']['before']:.1f} before, "
        f"{res['load_average']['after']:.1f} after. `python -m benchmarks.bench_gateway` "
        "reproduces it; docs/gateway.md says what the figures mean."])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--quick", action="store_true",
                   help="one round of 8 tokens; writes only where `python -m benchmarks --quick` "
                   "says")
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args(argv)
    if a.quick:
        a.rounds, a.tokens = 1, 8
    res = measure(a.rounds, a.tokens)
    markdown = report(res)
    print(markdown)
    publish("gateway", res, markdown, quick=a.quick, no_write=a.no_write, say=print)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
