"""Durable load/unload events per second through a real `statesvc serve`, next to raw SQLite.

    .venv/bin/python -m benchmarks.bench_events [--repeats 3] [--clients 4] ...

What it runs, and why: docs/benchmarks.md, "bench_events.py".
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from benchmarks.harness import (Figure, figure, machine_info, median, output_flags, publish, markdown_table,
    spread, target_lines)
from shared.client import ControlClient, RemoteError, new_event_id
from shared.events import AdapterLoaded, encode_body
from statesvc.tools.example import make_example
from testkit.fleet import cpu_seconds, loopback, start_ready, stop_pid

TARGET_EVENTS_PER_S = 1000.0
TARGET_RATIO = 0.5
NAMES_PER_CLIENT = 8  # each round loads these names, then unloads them: 16 events
MAX_LORAS = 64
MAX_RESENDS = 100  # storage_error answers a client resends (the same event_id) before failing
ROUND_TIMEOUT_S = 120.0  # a measurement that takes longer is broken, not slow

# Wide enough for the table when the output goes to a file or a pipe.
console = Console() if sys.stdout.isatty() else Console(width=100)


@dataclass(frozen=True)
class Settings:
    repeats: int
    clients: int
    concurrent_events: int
    single_events: int
    raw_events: int
    max_seconds: float


# ---- raw SQLite ------------------------------------------------------------------

def sample_payload() -> str:
    """The JSON of a typical adapter.loaded event, as the service stores it."""
    body = AdapterLoaded("b3-attn-all-r4", 123456, "ab" * 32, 17_400, 4, 4.0, 1.0, False,
                         ("q_proj", "k_proj", "v_proj", "o_proj"), False)
    return json.dumps(encode_body(body))


def open_raw(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("CREATE TABLE IF NOT EXISTS events (seq INTEGER PRIMARY KEY, "
                 "event_id VARCHAR(36) NOT NULL UNIQUE, type VARCHAR(64) NOT NULL, "
                 "payload JSON NOT NULL, recorded_at VARCHAR(32) NOT NULL, "
                 "actor VARCHAR(128) NOT NULL)")
    return conn


def measure_raw(conn: sqlite3.Connection, events: int, max_seconds: float) -> dict[str, Any]:
    payload = sample_payload()
    seq = int(conn.execute("SELECT coalesce(max(seq), 0) FROM events").fetchone()[0])
    done = 0
    t0 = time.monotonic()
    while done < events and time.monotonic() - t0 < max_seconds:
        seq += 1
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO events VALUES (?, ?, ?, ?, ?, ?)",
                     (seq, str(uuid.uuid4()), "adapter.loaded", payload,
                      "2026-11-29T15:03:00.000000+00:00", "local"))
        conn.execute("COMMIT")
        done += 1
    elapsed = time.monotonic() - t0
    return {"events": done, "seconds": elapsed, "events_per_s": done / elapsed}


# ---- the state service -----------------------------------------------------------

@dataclass
class Service:
    """A `statesvc serve` subprocess on free loopback ports, stopped by its pid."""

    data_dir: Path
    control: str = field(default_factory=loopback)
    publish: str = field(default_factory=loopback)
    extra_args: tuple[str, ...] = ()  # --db URL (benchmarks/bench_pg.py)
    proc: subprocess.Popen[Any] | None = None

    def start(self) -> Service:
        self.proc, _ = start_ready(
            [str(Path(sys.executable).parent / "statesvc"), "serve", "--data-dir",
             str(self.data_dir), "--control", self.control, "--publish", self.publish,
             *self.extra_args], log=self.data_dir.parent / f"statesvc-{self.data_dir.name}.log")
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop_pid(self.proc)

    def cpu_seconds(self) -> float:
        """User + system CPU the service has used so far, all threads (Linux /proc)."""
        assert self.proc is not None
        return cpu_seconds(self.proc.pid)


# ---- clients of the state service ------------------------------------------------

def client_loop(address: str, index: int, paths: list[str], events: int, max_seconds: float,
                barrier: Any, out: Any) -> None:
    """One client: a warm-up round, then load/unload rounds of its own names until done."""
    names = [(f"b{index}-{j}", paths[(index + j) % len(paths)]) for j in range(NAMES_PER_CLIENT)]
    resent = [0]  # storage_error answers, each resent with its event_id

    def one_round(client: ControlClient, lat: list[float] | None) -> None:
        for cmd in ("load", "unload"):
            for name, path in names:
                args = {"event_id": new_event_id(), "name": name}
                if cmd == "load":
                    args["path"] = path
                t = time.monotonic()
                for tries in range(MAX_RESENDS + 1):
                    try:
                        result = client.call(cmd, args)
                        break
                    except RemoteError as exc:  # several instances racing (bench_pg): resend
                        if exc.code != "storage_error" or tries == MAX_RESENDS:
                            raise
                        resent[0] += 1
                if lat is not None:
                    lat.append(time.monotonic() - t)
                if cmd == "load" and not result.get("created"):
                    raise RuntimeError(f"load {name} recorded no event: {result}")

    try:
        with ControlClient(address, timeout_s=30.0, retries=0) as client:
            one_round(client, None)
            barrier.wait(ROUND_TIMEOUT_S)
            lat: list[float] = []
            t0 = time.monotonic()
            while len(lat) < events and time.monotonic() - t0 < max_seconds:
                one_round(client, lat)
            t1 = time.monotonic()
        out.put({"index": index, "t0": t0, "t1": t1, "events": len(lat), "latencies": lat,
                 "resent": resent[0]})
    except Exception as exc:  # reported to the parent, which fails the measurement
        out.put({"index": index, "error": f"{type(exc).__name__}: {exc}"})


def measure_service(svc: Service, paths: list[str], clients: int, events: int,
                    max_seconds: float, *, others: tuple[Service, ...] = ()) -> dict[str, Any]:
    """`clients` processes, `events` in all (whole rounds); aggregate events/s and latency.
    With `others` (instances of one PostgreSQL log), client i writes through instance i mod n
    and the server CPU is theirs together."""
    services = (svc, *others)
    per_client = max(1, round(events / clients / (2 * NAMES_PER_CLIENT))) * 2 * NAMES_PER_CLIENT
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(clients)
    out = ctx.Queue()
    head_before = head_of(svc)
    cpu_before = sum(s.cpu_seconds() for s in services)
    procs = [ctx.Process(target=client_loop, name=f"bench-client-{i}",
                         args=(services[i % len(services)].control, i, paths, per_client,
                               max_seconds, barrier, out))
             for i in range(clients)]
    reports: list[dict[str, Any]] = []
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + max_seconds + ROUND_TIMEOUT_S
        all_gone_at: float | None = None
        while len(reports) < clients:
            try:
                reports.append(out.get(timeout=0.5))
                continue
            except queue.Empty:
                pass
            now = time.monotonic()
            if all_gone_at is None and not any(p.is_alive() for p in procs):
                all_gone_at = now  # a last report may still be in the queue's pipe
            if now > deadline or (all_gone_at is not None and now - all_gone_at > 2.0):
                codes = [p.exitcode for p in procs]
                raise RuntimeError(f"only {len(reports)} of {clients} clients reported "
                                   f"(exit codes {codes})")
        for p in procs:
            p.join(10)
    finally:
        for p in procs:  # by pid, and only those we started
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
    errors = [r["error"] for r in reports if "error" in r]
    if errors:
        raise RuntimeError("client failed: " + "; ".join(errors))
    cpu = sum(s.cpu_seconds() for s in services) - cpu_before
    total = sum(r["events"] for r in reports)
    elapsed = max(r["t1"] for r in reports) - min(r["t0"] for r in reports)
    lat = sorted(x for r in reports for x in r["latencies"])
    head_after = head_of(svc)
    warmup = clients * 2 * NAMES_PER_CLIENT
    if head_after - head_before != total + warmup:
        raise RuntimeError(f"the log grew by {head_after - head_before} events; the clients "
                           f"were answered for {total + warmup}")
    commits = count_commits(svc, head_before + warmup, head_after)
    return {"events": total, "seconds": elapsed, "events_per_s": total / elapsed,
            "commits": commits, "events_per_commit": total / commits,
            "server_cpu_ms_per_event": 1000 * cpu / (total + warmup),
            "resent": sum(r["resent"] for r in reports),
            "latency_ms_p50": 1000 * lat[len(lat) // 2],
            "latency_ms_p99": 1000 * lat[min(len(lat) - 1, int(len(lat) * 0.99))]}


def head_of(svc: Service) -> int:
    with ControlClient(svc.control) as client:
        return int(client.call("list")["head_seq"])


def count_commits(svc: Service, since: int, until: int) -> int:
    """Commits that wrote seqs since < seq <= until: one `recorded_at` per commit."""
    stamps: set[str] = set()
    with ControlClient(svc.control) as client:
        while since < until:
            page = client.call("events", {"since": since, "limit": 1000})["events"]
            page = [e for e in page if e["seq"] <= until]
            if not page:
                break
            stamps.update(e["recorded_at"] for e in page)
            since = page[-1]["seq"]
    return max(1, len(stamps))


def init_pool(svc: Service, model_dir: Path, max_loras: int = MAX_LORAS) -> None:
    with ControlClient(svc.control) as client:
        client.call("pool.init", {"event_id": new_event_id(), "model": str(model_dir),
                                  "max_loras": max_loras, "max_rank": 32, "targets": "all"})


# ---- the run ---------------------------------------------------------------------

KINDS = ("raw", "concurrent", "single")


def run(settings: Settings) -> dict[str, Any]:
    if settings.clients * NAMES_PER_CLIENT > MAX_LORAS:
        raise SystemExit(f"--clients {settings.clients} needs "
                         f"{settings.clients * NAMES_PER_CLIENT} slots, above the pool's "
                         f"{MAX_LORAS}; use at most {MAX_LORAS // NAMES_PER_CLIENT} clients")
    load_before = os.getloadavg()[0]
    if load_before > 0.5 * (os.cpu_count() or 1):
        console.print(f"[yellow]load average {load_before:.1f} on {os.cpu_count()} CPUs: other "
                      "processes are busy, so the figures will be low and noisy[/yellow]")
    root = Path(tempfile.mkdtemp(prefix="loraplane-bench-"))
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in KINDS}
    svc = Service(root / "data")
    raw = None
    try:
        example = make_example(root / "example", seed=0)
        paths = [str(p) for p in example.adapter_dirs.values()]
        raw = open_raw(root / "raw.db")
        svc.start()
        init_pool(svc, example.model_dir)
        pid = svc.proc.pid if svc.proc else "?"
        console.print(f"[dim]temp dir {root}; statesvc pid {pid}; warming up[/dim]")
        measure_raw(raw, 500, settings.max_seconds)
        measure_service(svc, paths, settings.clients, 4 * 16 * settings.clients,
                        settings.max_seconds)
        for rep in range(settings.repeats):
            for kind in KINDS:
                if kind == "raw":
                    r = measure_raw(raw, settings.raw_events, settings.max_seconds)
                elif kind == "concurrent":
                    r = measure_service(svc, paths, settings.clients, settings.concurrent_events,
                                        settings.max_seconds)
                else:
                    r = measure_service(svc, paths, 1, settings.single_events,
                                        settings.max_seconds)
                runs[kind].append(r)
                console.print(f"[dim]run {rep + 1}/{settings.repeats} {kind:<10} "
                              f"{r['events_per_s']:>8.0f} events/s  ({r['events']} events in "
                              f"{r['seconds']:.2f} s)[/dim]")
    except BaseException:
        log = root / "statesvc-data.log"
        if log.is_file():
            console.print(f"[red]statesvc log (last lines):[/red]\n{log.read_text()[-2000:]}")
        raise
    finally:
        svc.stop()
        if raw is not None:
            raw.close()
        shutil.rmtree(root, ignore_errors=True)
    load = {"loadavg_1m_before": round(load_before, 2),
            "loadavg_1m_after": round(os.getloadavg()[0], 2)}
    return summarize(settings, runs, root, load)


def summarize(settings: Settings, runs: dict[str, list[dict[str, Any]]], root: Path,
              load: dict[str, float]) -> dict[str, Any]:
    med = {k: median([r["events_per_s"] for r in runs[k]]) for k in KINDS}
    # a ratio is the median of each repeat's ratio (the raw loop runs beside the service in
    # every repeat), as benchmarks/suite.py reports it
    per_repeat = {k: [c["events_per_s"] / r["events_per_s"] for c, r in zip(runs[k], runs["raw"])]
                  for k in KINDS}
    ratio = median(per_repeat["concurrent"])
    targets = [
        {"name": f"{settings.clients} clients, events/s",
         "target": f">= {TARGET_EVENTS_PER_S:,.0f}", "measured": round(med["concurrent"], 1),
         "met": med["concurrent"] >= TARGET_EVENTS_PER_S},
        {"name": f"{settings.clients} clients / raw SQLite", "target": f">= {TARGET_RATIO}x",
         "measured": round(ratio, 3), "met": ratio >= TARGET_RATIO},
    ]
    return {
        "benchmark": "events",
        "machine": {**machine_info(), "temp_dir_parent": str(root.parent), **load},
        "settings": {"repeats": settings.repeats, "clients": settings.clients,
                     "names_per_client": NAMES_PER_CLIENT, "max_loras": MAX_LORAS,
                     "events": {"raw": settings.raw_events,
                                "concurrent": settings.concurrent_events,
                                "single": settings.single_events},
                     "max_seconds": settings.max_seconds},
        "median_events_per_s": {k: round(v, 1) for k, v in med.items()},
        "ratio_concurrent_to_raw": round(ratio, 3),
        "ratio_single_to_raw": round(median(per_repeat["single"]), 3),
        "ratio_concurrent_to_raw_per_repeat": [round(x, 3) for x in per_repeat["concurrent"]],
        "targets": targets,
        "runs": runs,
    }


def _label(kind: str, clients: int) -> str:
    return {"raw": "raw sqlite3",
            "concurrent": f"statesvc, {clients} clients",
            "single": "statesvc, 1 client"}[kind]


COLUMNS = ("measurement", "events/s", "x raw", "events/commit", "server CPU ms/event",
           "p50 ms", "p99 ms")


def render(result: dict[str, Any]) -> str:
    """The bench:events section (docs/results-detail.md): the figures, what they measure, the verdicts."""
    clients = result["settings"]["clients"]
    med = result["median_events_per_s"]
    rows = []
    for kind in KINDS:
        runs = result["runs"][kind]
        x_raw = {"raw": 1.0, "concurrent": result["ratio_concurrent_to_raw"],
                 "single": result["ratio_single_to_raw"]}[kind]
        cells = [_label(kind, clients), f"{med[kind]:,.0f}", f"{x_raw:.2f}"]
        if kind == "raw":
            cells += ["1.0", "", "", ""]
        else:
            for key, fmt in (("events_per_commit", "{:.1f}"),
                             ("server_cpu_ms_per_event", "{:.2f}"),
                             ("latency_ms_p50", "{:.2f}"), ("latency_ms_p99", "{:.2f}")):
                cells.append(fmt.format(median([r[key] for r in runs])))
        rows.append(cells)
    lines = markdown_table(COLUMNS, rows)
    lines.append("")
    lines.append("raw sqlite3: one `BEGIN IMMEDIATE; INSERT; COMMIT` per row (WAL, "
                 "synchronous=FULL) in the same temp dir as the service's data dir. statesvc: "
                 f"each client process ({clients}, then 1) loads then unloads its own "
                 f"{NAMES_PER_CLIENT} adapter names in a loop; a reply means the event is "
                 "durable. events/commit: how many events shared one commit (group commit).")
    lines.append("")
    lines += target_lines(result)
    m = result["machine"]
    lines.append(f"\n{m['nproc']} CPUs, Python {m['python']}, load average "
                 f"{m['loadavg_1m_before']} before the run, {m['date']}. "
                 "`make bench` (`python -m benchmarks.bench_events`) reproduces it; "
                 "`benchmarks/results/events.json` has every run.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--concurrent-events", type=int, default=6400,
                    help="events per concurrent measurement, in all (whole rounds of 16)")
    ap.add_argument("--single-events", type=int, default=3200)
    ap.add_argument("--raw-events", type=int, default=20000)
    ap.add_argument("--max-seconds", type=float, default=15.0,
                    help="a measurement stops after this long, with the events done so far")
    output_flags(ap, "events", "a smoke run: one short repeat")
    a = ap.parse_args(argv)
    settings = Settings(a.repeats, a.clients, a.concurrent_events, a.single_events,
                        a.raw_events, a.max_seconds)
    if a.quick:
        settings = Settings(1, a.clients, 64 * a.clients, 64, 500, 5.0)
    result = run(settings)
    markdown = render(result)
    print(markdown)
    publish("events", result, markdown, quick=a.quick, no_write=a.no_write)
    return 0


def figures(r: dict[str, Any]) -> list[Figure]:
    runs = r["runs"]
    rate = {k: [x["events_per_s"] for x in runs[k]] for k in ("raw", "concurrent", "single")}
    clients = r["settings"]["clients"]
    out = []
    for kind, label in (("concurrent", f"{clients} clients"), ("single", "1 client")):
        ratios = [a / b for a, b in zip(rate[kind], rate["raw"])]
        meets_rate = median(rate[kind]) >= 1000 if kind == "concurrent" else None
        out.append(figure("events", f"event append, {label}", median(rate[kind]), "events/s",
                          target=">= 1,000" if kind == "concurrent" else None, meets=meets_rate,
                          spread=spread(rate[kind]), runs=len(rate[kind])))
        out.append(figure("events", f"event append, {label} / raw sqlite3", median(ratios), "x",
                          target=">= 0.5x" if kind == "concurrent" else None,
                          meets=median(ratios) >= 0.5 if kind == "concurrent" else None,
                          spread=spread(ratios), runs=len(ratios)))
    return out


if __name__ == "__main__":
    sys.exit(main())
