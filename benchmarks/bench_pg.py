"""Durable events/s with the log on PostgreSQL, 1 and 2 statesvc instances, next to raw psycopg.

    .venv/bin/python -m benchmarks.bench_pg [--repeats 3] [--quick]
        [--only propagation|events|bootstrap]

What it runs, and why: docs/benchmarks.md, "bench_pg.py".
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from rich.console import Console

from benchmarks.bench_events import NAMES_PER_CLIENT, Service, init_pool, measure_service, \
    sample_payload
from benchmarks.harness import (Figure, figure, machine_info, median, output_flags, markdown_table, publish,
    spread, target_lines)
from statesvc.tools.example import make_example
from benchmarks.pg_fleet import ROLES, Settings, measure_bootstrap, measure_propagations
from testkit.pg import PgServer

TARGET_RATIO = 0.5
TARGET_FANOUT = 3.0  # propagation p99 to the most replicas over the p99 to one
INSTANCES = (1, 2)
CLIENTS = (4, 16)

console = Console() if sys.stdout.isatty() else Console(width=100)


def steal_seconds() -> float:
    """CPU seconds the hypervisor has run other guests on this VM's CPUs (/proc/stat `steal`),
    all CPUs together; NaN where /proc does not say."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def measure_raw(dsn: str, events: int, max_seconds: float) -> dict[str, Any]:
    import psycopg

    payload = sample_payload()
    with psycopg.connect(dsn) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS raw_events (seq BIGINT PRIMARY KEY, "
                     "event_id VARCHAR(36) NOT NULL UNIQUE, type VARCHAR(64) NOT NULL, "
                     "payload JSON NOT NULL, recorded_at VARCHAR(32) NOT NULL, "
                     "actor VARCHAR(128) NOT NULL)")
        conn.commit()
        row = conn.execute("SELECT coalesce(max(seq), 0) FROM raw_events").fetchone()
        seq = int(row[0]) if row else 0
        conn.commit()
        done = 0
        t0 = time.monotonic()
        while done < events and time.monotonic() - t0 < max_seconds:
            seq += 1
            conn.execute("INSERT INTO raw_events VALUES (%s, %s, %s, %s, %s, %s)",
                         (seq, str(uuid.uuid4()), "adapter.loaded", payload,
                          "2026-11-29T15:03:00.000000+00:00", "local"))
            conn.commit()
            done += 1
        elapsed = time.monotonic() - t0
    return {"events": done, "seconds": elapsed, "events_per_s": done / elapsed}


def measure_events(settings: Settings, server: PgServer, root: Path,
                   runs: dict[str, list[dict[str, Any]]], services: list[Service]) -> None:
    """The raw loop and every N x C configuration, interleaved, `settings.repeats` times, into
    `runs`; the statesvc instances it starts go into `services` (the caller stops them)."""
    example = make_example(root / "example", seed=0)
    paths = [str(p) for p in example.adapter_dirs.values()]
    url = server.database()
    raw_dsn = server.database().replace("+psycopg", "")
    for i in range(max(INSTANCES)):
        services.append(Service(root / f"s{i}", extra_args=("--db", url)).start())
    init_pool(services[0], example.model_dir, max_loras=max(CLIENTS) * NAMES_PER_CLIENT)
    console.print(f"[dim]temp dir {root}; PostgreSQL pid {server.pid}; warming up[/dim]")
    measure_raw(raw_dsn, 200, settings.max_seconds)
    measure_service(services[0], paths, 4, 4 * 16, settings.max_seconds,
                    others=tuple(services[1:]))
    for rep in range(settings.repeats):
        for k in runs:
            stolen = steal_seconds()
            if k == "raw":
                r = measure_raw(raw_dsn, settings.raw_events, settings.max_seconds)
            else:
                n, c = (int(x) for x in k.split("x"))
                r = measure_service(services[0], paths, c, settings.events,
                                    settings.max_seconds, others=tuple(services[1:n]))
            # CPU time the hypervisor gave other guests meanwhile: a VM's slow repeats
            r["steal_ms_per_s"] = round((steal_seconds() - stolen) / r["seconds"] * 1000, 1)
            runs[k].append(r)
            console.print(f"[dim]run {rep + 1}/{settings.repeats} {k:<6} "
                          f"{r['events_per_s']:>8.0f} events/s ({r['events']} events in "
                          f"{r['seconds']:.2f} s; steal {r['steal_ms_per_s']} ms/s)[/dim]")


def key(instances: int, clients: int) -> str:
    return f"{instances}x{clients}"


def run(settings: Settings) -> dict[str, Any] | None:
    why = PgServer.missing()
    if why is not None:
        console.print(f"[yellow]skipped: {why}[/yellow]")
        return None
    load_before = os.getloadavg()[0]
    root = Path(tempfile.mkdtemp(prefix="loraplane-bench-pg-"))
    server = PgServer()
    services: list[Service] = []
    configs = [key(n, c) for n in INSTANCES for c in CLIENTS] if settings.events_too else []
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in ["raw", *configs]} \
        if settings.events_too else {}
    try:
        server.start()
        if settings.events_too:
            measure_events(settings, server, root, runs, services)
        for svc in services:
            svc.stop()
        propagation = measure_propagations(settings, server, root) \
            if settings.propagation_too else []
        bootstrap = measure_bootstrap(settings, server, root) if settings.bootstrap_too \
            else None
    finally:
        for svc in services:
            svc.stop()
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
    ratios = {k: [r["events_per_s"] / raw["events_per_s"] for r, raw in zip(runs[k], runs["raw"])]
              for k in configs}
    targets = [{"name": f"{k.replace('x', ' statesvc, ')} clients / raw psycopg",
                "target": f">= {TARGET_RATIO}x", "measured": round(median(ratios[k]), 3),
                "met": median(ratios[k]) >= TARGET_RATIO} for k in configs]
    if propagation:
        most = propagation[-1]
        targets.append({"name": f"propagation p99, {most['replicas']} replicas / 1 replica",
                        "target": f"<= {TARGET_FANOUT}x", "measured": most["p99_over_one"],
                        "met": most["p99_over_one"] <= TARGET_FANOUT})
    return {
        "benchmark": "pg",
        "machine": {**machine_info(), "loadavg_1m_before": round(load_before, 2),
                    "loadavg_1m_after": round(os.getloadavg()[0], 2)},
        "settings": {"repeats": settings.repeats, "events": settings.events,
                     "replica_counts": list(settings.replica_counts), "loads": settings.loads,
                     "raw_events": settings.raw_events, "max_seconds": settings.max_seconds,
                     "instances": list(INSTANCES), "clients": list(CLIENTS)},
        "median_events_per_s": {k: round(median([r["events_per_s"] for r in v]), 1)
                                for k, v in runs.items()},
        "ratio_to_raw": {k: round(median(v), 3) for k, v in ratios.items()},
        "ratio_to_raw_per_repeat": {k: [round(x, 3) for x in v] for k, v in ratios.items()},
        "propagation": propagation,
        "bootstrap": bootstrap,
        "targets": targets,
        "runs": runs,
    }


COLUMNS = ("measurement", "events/s", "x raw", "events/commit", "server CPU ms/event",
           "p50 ms", "p99 ms", "resent")


def render(result: dict[str, Any]) -> str:
    med, ratio = result["median_events_per_s"], result["ratio_to_raw"]
    rows = []
    for k, runs in result["runs"].items():
        if k == "raw":
            cells = ["raw psycopg, INSERT + COMMIT", f"{med[k]:,.0f}", "1.00", "1.0", "", "", "",
                     ""]
        else:
            n, c = k.split("x")
            cells = [f"{n} statesvc, {c} clients", f"{med[k]:,.0f}", f"{ratio[k]:.2f}"]
            for field, fmt in (("events_per_commit", "{:.1f}"),
                               ("server_cpu_ms_per_event", "{:.2f}"),
                               ("latency_ms_p50", "{:.2f}"), ("latency_ms_p99", "{:.2f}")):
                cells.append(fmt.format(median([r[field] for r in runs])))
            cells.append(str(sum(r.get("resent", 0) for r in runs)))
        rows.append(cells)
    lines = markdown_table(COLUMNS, rows) if rows else []  # none: `--only propagation`
    lines += ["", "| propagation | from ack p50 ms | p99 ms | p99 / 1 replica | CPU ms a "
              "load: replicas | statesvc | postgres | bench | load average |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|"] \
        if result["propagation"] else []  # empty: `--only events`
    for p in result["propagation"]:
        cpu = p.get("cpu_ms_per_load", {})
        lines.append(f"| {p['replicas']} replica(s), {p['loads']} loads | "
                     f"{p['from_ack_ms_p50']:.1f} | {p['from_ack_ms_p99']:.1f} | "
                     f"{p['p99_over_one']:.2f} | "
                     + " | ".join(f"{cpu.get(r, 0):.0f}" for r in ROLES)
                     + f" | {'-'.join(map(str, p.get('loadavg_1m', [])))} |")
    boot = result.get("bootstrap")
    if boot:
        lines += ["", f"| bootstrap: {boot['new']} new replicas beside {boot['warm']} holding "
                  f"{boot['adapters']} adapters | blobs from statesvc | from peers | statesvc "
                  "CPU s | PostgreSQL CPU s | READY to head s (slowest) | wall s |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for mode, label in (("peers", "peer blobs (default)"),
                            ("statesvc", "`--no-peer-blobs`")):
            b = boot["median"][mode]
            lines.append(f"| {label} | {b['statesvc_blob_fetches']:.0f} | "
                         f"{b['peer_blob_fetches']:.0f} | {b['statesvc_cpu_s']:.2f} | "
                         f"{b['postgres_cpu_s']:.2f} | {b['ready_to_head_s']:.2f} | "
                         f"{b['wall_s']:.2f} |")
    m = result["machine"]
    lines += ["", "One PostgreSQL server started by the benchmark (fsync=on, "
              "synchronous_commit=on); raw psycopg: one connection, one INSERT + COMMIT per "
              "row. statesvc: each client process loads then unloads its own "
              f"{NAMES_PER_CLIENT} names; with 2 instances client i writes through instance "
              "i mod 2. server CPU: all instances together. resent: commands answered "
              "storage_error (an instance that lost the append race 16 times in a row) and "
              "resent with their event_id, over all repeats. CPU ms a load: CPU time "
              "each role used while the loads ran, over the loads (each load is followed "
              "by its unload): with more replicas than cores, the replicas' own work "
              "(fetch, sha256, parse, slot write) queues behind each other's.", ""]
    raw_steal = [r["steal_ms_per_s"] for r in result["runs"].get("raw", [])
                 if "steal_ms_per_s" in r]
    if raw_steal:
        lines += [f"Steal time (CPU the hypervisor gave other guests) during the raw loop's "
                  f"repeats: {', '.join(f'{x:.0f}' for x in raw_steal)} ms/s; every run's is in "
                  "pg.json (`steal_ms_per_s`).", ""]
    lines += target_lines(result)
    lines.append(f"\n{m.get('cpu')}, {m['nproc']} CPUs, load average {m['loadavg_1m_before']} "
                 f"before the run, {m['date']}. `python -m benchmarks.bench_pg` reproduces it.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--events", type=int, default=3200,
                    help="events per statesvc measurement, in all (whole rounds of 16 a client)")
    ap.add_argument("--raw-events", type=int, default=5000)
    ap.add_argument("--max-seconds", type=float, default=15.0)
    ap.add_argument("--replicas", default="1,4,16", help="replica counts, comma-separated")
    ap.add_argument("--loads", type=int, default=30, help="loads per propagation measurement")
    output_flags(ap, "pg", "a smoke run: one short repeat")
    ap.add_argument("--bootstrap-warm", type=int, default=4,
                    help="replicas holding the adapters when the new ones start")
    ap.add_argument("--bootstrap-new", type=int, default=8,
                    help="replicas started at once, with and without peer blobs")
    ap.add_argument("--only", choices=("propagation", "events", "bootstrap"),
                    help="measure only this (the propagation or the events/s runs); like "
                         "--quick, it writes results only under LORAPLANE_BENCH_OUT")
    a = ap.parse_args(argv)
    counts = tuple(int(x) for x in a.replicas.split(","))
    events_too, propagation_too, bootstrap_too = (a.only in (None, what) for what in
                                                  ("events", "propagation", "bootstrap"))
    settings = Settings(a.repeats, a.events, a.raw_events, a.max_seconds, counts, a.loads,
                        events_too, propagation_too, a.bootstrap_warm, a.bootstrap_new,
                        bootstrap_too=bootstrap_too)
    if a.quick:
        settings = Settings(1, 256, 200, 5.0, (1, 2), 4, events_too, propagation_too,
                            bootstrap_warm=1, bootstrap_new=2, bootstrap_adapters=2,
                            bootstrap_too=bootstrap_too)
    result = run(settings)
    if result is None:
        return 0
    # a partial run, like a quick one, writes only where LORAPLANE_BENCH_OUT points
    markdown = render(result)
    print(markdown)
    publish("pg", result, markdown, quick=a.quick or a.only is not None, no_write=a.no_write)
    return 0


def figures(r: dict[str, Any]) -> list[Figure]:
    out = []
    for k, per_repeat in r["ratio_to_raw_per_repeat"].items():
        n, c = k.split("x")
        rates = [x["events_per_s"] for x in r["runs"][k]]
        label = f"event append on PostgreSQL, {n} statesvc, {c} clients"
        out.append(figure("pg", label, median(rates), "events/s", spread=spread(rates),
                          runs=len(rates)))
        out.append(figure("pg", f"{label} / raw psycopg", median(per_repeat), "x",
                          target=">= 0.5x", meets=median(per_repeat) >= 0.5,
                          spread=spread(per_repeat), runs=len(per_repeat)))
    props = r.get("propagation") or []
    for p in props[1:]:
        n = p["replicas"]
        target = "<= 3x" if p is props[-1] else None
        out.append(figure("pg", f"propagation on PostgreSQL, ack to applied p99, {n} replicas / "
                                "1 replica", p["p99_over_one"], "x", target=target,
                          meets=p["p99_over_one"] <= 3 if target else None))
    boot = r.get("bootstrap")
    if boot:
        runs = boot["runs"]
        label = f"bootstrap of {boot['new']} new replicas beside {boot['warm']}"
        for key, what in (("statesvc_blob_fetches", "blobs served by statesvc"),
                          ("peer_blob_fetches", "blobs served by peers")):
            xs = [x[key] for x in runs["peers"]]
            out.append(figure("pg", f"{label}, {what}, peer blobs on", median(xs), "blobs",
                              spread=spread(xs), runs=len(xs)))
        for key, what in (("statesvc_cpu_s", "statesvc CPU"),
                          ("ready_to_head_s", "READY to head, slowest")):
            xs = [a[key] / b[key] for a, b in zip(runs["peers"], runs["statesvc"]) if b[key]]
            if xs:
                out.append(figure("pg", f"{label}, {what}, peer blobs / --no-peer-blobs",
                                  median(xs), "x", spread=spread(xs), runs=len(xs)))
    return out


if __name__ == "__main__":
    sys.exit(main())
