"""The gateway beside hostile clients: what a good client sees while they run (issue 50).

    .venv/bin/python -m benchmarks.bench_gateway_hostile [--requests 40] [--seconds 8]
        [--quick] [--no-write]

What it runs, and why: docs/benchmarks.md, "bench_gateway_hostile.py".
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from benchmarks.harness import (Figure, Fleet, cpu_model, figure, machine_info, median, output_flags, percentile,
    run_and_publish)
from statesvc.tools.example import make_example
from testkit.fleet import memory_kb

SLOW, FLOODERS = 300, 8
OVERSIZED = "漢" * (1 << 18)  # 786 KB of UTF-8, 262,144 characters
SMALL = {"model": "model", "prompt": "Hello", "max_tokens": 4, "temperature": 0}


def slow_connections(address: tuple[str, int], stop: threading.Event) -> None:
    """Keep SLOW slow connections open until `stop`, each answered one opened again."""
    body = json.dumps(SMALL).encode()
    openers = [b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ",
               b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"b" * (256 << 10),
               b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
               b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body)]

    def opened(i: int) -> socket.socket:
        sock = socket.create_connection(address, timeout=10)
        sock.sendall(openers[i % 3])
        sock.setblocking(False)
        return sock

    socks = [opened(i) for i in range(SLOW)]
    try:
        while not stop.is_set():
            for i, sock in enumerate(socks):
                try:
                    sock.recv(65536)  # returns once answered (408) or closed: a new one
                except BlockingIOError:  # still open: one byte more of its head or body
                    if i % 3 != 1:
                        try:
                            sock.send(b"x")
                        except OSError:
                            pass
                    continue
                except OSError:
                    pass
                sock.close()
                socks[i] = opened(i)
            stop.wait(0.2)
    finally:
        for sock in socks:
            sock.close()


def flood(url: str, stop: Any, answers: Any) -> None:
    """FLOODERS clients, each sending oversized prompts one after another until `stop`; run
    in a process of its own, so that their sends do not hold the measuring client's GIL.
    `answers` (a managed dict) gets how many got each status."""
    os.nice(19)  # the flood's own CPU, another machine's in earnest, taken last from the fleet
    body = json.dumps({"model": "model", "prompt": OVERSIZED, "max_tokens": 4},
                      ensure_ascii=False).encode()
    got: Counter[int] = Counter()
    lock = threading.Lock()

    def client() -> None:
        with httpx.Client(base_url=url, timeout=60) as c:
            while not stop.is_set():
                r = c.post("/v1/completions", content=body,
                           headers={"content-type": "application/json"})
                with lock:
                    got[r.status_code] += 1

    threads = [threading.Thread(target=client) for _ in range(FLOODERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    answers.update({str(k): v for k, v in got.items()})


def small_latencies(client: httpx.Client, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        r = client.post("/v1/completions", json=SMALL)
        out.append((time.perf_counter() - t0) * 1e3)
        assert r.status_code == 200, r.text
    return out


def run(a: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-hostile-"))
    example = make_example(tmp / "example", seed=0)
    fleet = Fleet(tmp, example.model_dir, max_loras=2, max_rank=8,
                  replica_args=("--no-warmup",) if a.quick else (),
                  gateway=("--head-timeout", "2", "--body-timeout", "2"))
    gateway = fleet.gateway
    assert gateway is not None
    load = os.getloadavg()[0]
    try:
        fleet.start()
        with httpx.Client(base_url=gateway.url, timeout=60) as client:
            small_latencies(client, 5)  # compiled, connected
            # slow connections, and a good client beside them
            stop, rss_before = threading.Event(), memory_kb(gateway.pid, "VmRSS")
            slow = threading.Thread(target=slow_connections,
                                    args=(("127.0.0.1", gateway.port), stop))
            slow.start()
            good_ms, rss_peak = [], rss_before
            deadline = time.monotonic() + a.seconds
            while time.monotonic() < deadline:
                t0 = time.perf_counter()
                assert httpx.get(gateway.url + "/v1/models", timeout=60).status_code == 200
                good_ms.append((time.perf_counter() - t0) * 1e3)
                good_ms += small_latencies(client, 1)
                rss_peak = max(rss_peak, memory_kb(gateway.pid, "VmRSS"))
                time.sleep(0.05)
            stop.set()
            slow.join()
            # small completions alone, then beside a flood of oversized prompts
            alone = small_latencies(client, a.requests)
            spawn = multiprocessing.get_context("spawn")
            with spawn.Manager() as manager:
                flood_stop, answered = manager.Event(), manager.dict()
                flooders = spawn.Process(target=flood, args=(gateway.url, flood_stop, answered))
                flooders.start()
                time.sleep(2.0)  # the process started and every flooder sending
                during = small_latencies(client, a.requests)
                flood_stop.set()
                flooders.join(60)
                answers = dict(answered)
            rss_after_flood = memory_kb(gateway.pid, "VmRSS")
    finally:
        fleet.stop()
    slowest, grown = max(good_ms), (rss_peak - rss_before) / 1024
    ratio = median(during) / median(alone)
    return {"cpu": f"{cpu_model()}, {os.cpu_count()} CPUs", "machine": machine_info(),
            "load_average": {"before": load, "after": os.getloadavg()[0]},
            "slow": {"connections": SLOW, "seconds": a.seconds, "good_answers": len(good_ms),
                     "good_p50_ms": median(good_ms), "good_p99_ms": percentile(good_ms, 99),
                     "good_max_ms": slowest, "rss_before_mb": rss_before / 1024,
                     "rss_grown_mb": grown},
            "flood": {"flooders": FLOODERS, "prompt_bytes": len(OVERSIZED.encode()),
                      "requests": a.requests, "alone_p50_ms": median(alone),
                      "during_p50_ms": median(during), "ratio": ratio,
                      "oversized_answers": dict(sorted(answers.items())),
                      "rss_after_mb": rss_after_flood / 1024},
            "targets": [
                {"name": f"good client's slowest answer beside {SLOW} slow connections",
                 "target": "<= 500 ms", "measured": round(slowest, 1), "met": slowest <= 500},
                {"name": f"gateway RSS growth beside {SLOW} slow connections",
                 "target": "< 100 MB", "measured": round(grown, 1), "met": grown < 100},
                {"name": f"small completions' p50 beside {FLOODERS} oversized-prompt clients "
                         "/ alone", "target": "<= 3x", "measured": round(ratio, 2),
                 "met": ratio <= 3}]}


def report(r: dict[str, Any]) -> str:
    """The bench:hostile section (docs/results-detail.md)."""
    s, f = r["slow"], r["flood"]
    verdicts = {t["name"]: "PASS" if t["met"] else "MISS" for t in r["targets"]}
    v = list(verdicts.values())
    return "\n".join([
        "| beside | good client p50 / p99 / slowest | target | gateway RSS growth | target |",
        "|---|---:|---|---:|---|",
        f"| {s['connections']} slow or oversized connections, {s['seconds']:g} s | "
        f"{s['good_p50_ms']:.1f} / {s['good_p99_ms']:.1f} / {s['good_max_ms']:.1f} ms | "
        f"<= 500 ms: {v[0]} | {s['rss_grown_mb']:+.1f} MB | < 100 MB: {v[1]} |",
        "",
        "| small completions | alone p50 | beside the flood p50 | ratio | target | oversized "
        "prompts answered |",
        "|---|---:|---:|---:|---|---|",
        f"| {f['requests']}, one at a time, {f['flooders']} clients sending "
        f"{f['prompt_bytes'] / 1e3:.0f} KB prompts | {f['alone_p50_ms']:.1f} ms | "
        f"{f['during_p50_ms']:.1f} ms | {f['ratio']:.2f}x | <= 3x: {v[2]} | "
        + ", ".join(f"{n} x {k}" for k, n in f["oversized_answers"].items()) + " |",
        "",
        "The example model, one warmed-up replica, the gateway with its defaults but "
        "--head-timeout and --body-timeout 2 s. Slow connections: a third dribble a head, a "
        "third send 256 KiB of a header and stop, a third dribble a body, each one the gateway "
        "answers (408, 431) opened again; the good client alternates GET /v1/models on a new "
        "connection and a 4-token completion. Flood: 8 clients in a process of their own at "
        "nice 19 (their CPU is another machine's in earnest), prompts no context holds, "
        "refused by their length before they are tokenized (docs/gateway.md, \"Hostile clients\"). "
        f"On {r['cpu']}; load average {r['load_average']['before']:.1f} before, "
        f"{r['load_average']['after']:.1f} after. "
        "`python -m benchmarks.bench_gateway_hostile` reproduces it."])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=40,
                   help="small completions alone, and again beside the flood")
    p.add_argument("--seconds", type=float, default=8.0,
                   help="how long the slow connections run beside the good client")
    output_flags(p, "hostile", "a replica without warm-up, 8 requests, 3 s of slow "
                 "connections; writes only where `python -m benchmarks --quick` says")
    a = p.parse_args(argv)
    if a.quick:
        a.requests, a.seconds = 8, 3.0
    return run_and_publish("hostile", a, run, report)


def figures(r: dict[str, Any]) -> list[Figure]:
    """Issue 50: a good client's slowest answer and the gateway's RSS beside 300 slow or
    oversized connections, and small completions beside a flood of oversized prompts over
    alone (bench_gateway_hostile); beside them the good client's p50 and the flood's."""
    units = ("ms", "MB", "x")
    out = [figure("hostile", t["name"], t["measured"], unit, target=t["target"], meets=t["met"])
           for t, unit in zip(r["targets"], units)]
    flood = r["flood"]
    out += [figure("hostile", f"good client's p50 beside {r['slow']['connections']} slow "
                              "connections", r["slow"]["good_p50_ms"], "ms"),
            figure("hostile", "small completions' p50 alone", flood["alone_p50_ms"], "ms"),
            figure("hostile", f"small completions' p50 beside {flood['flooders']} "
                              "oversized-prompt clients", flood["during_p50_ms"], "ms")]
    return out


if __name__ == "__main__":
    raise SystemExit(main())
