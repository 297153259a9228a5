"""bench_pg's fleets on one PostgreSQL server: propagation to pool-only replicas following one
`statesvc --db`, with the CPU each role used, and new replicas bootstrapping beside warm ones.

What they run, and why: docs/benchmarks.md, "bench_pg.py".
"""
from __future__ import annotations

import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from benchmarks.harness import Fleet, median
from shared.client import ControlClient
from statesvc.tools.example import make_example
from testkit.fleet import Computed, StateSvc, cpu_seconds, thread_cpu, wait_for
from testkit.pg import PgServer

console = Console()


@dataclass(frozen=True)
class Settings:
    repeats: int
    events: int  # per service measurement, in all
    raw_events: int
    max_seconds: float
    replica_counts: tuple[int, ...]
    loads: int
    events_too: bool = True  # False (`--only propagation`): the propagation figures alone
    propagation_too: bool = True  # False (`--only events`): the events/s figures alone
    bootstrap_warm: int = 4  # replicas that hold the adapters when the new ones start
    bootstrap_new: int = 8  # replicas started at once, with and without peer blobs
    bootstrap_adapters: int = 16
    bootstrap_too: bool = True


ROLES = ("replicas", "statesvc", "postgres", "bench")


def cpu_by_role(tag: str, pg_root: str) -> dict[str, float]:
    """CPU seconds used so far by the processes of one propagation measurement (`tag` in
    their command lines), PostgreSQL's (started with `-k pg_root`, and its backends), and
    this process; and "replicas/NAME", "statesvc/NAME" for each thread name of those two
    (shared/threadname.py names the services' own threads; "computed" and "statesvc" are
    the main thread and any thread left unnamed)."""
    out = dict.fromkeys(ROLES, 0.0)
    own = os.times()
    out["bench"] = own.user + own.system
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        role = ("replicas" if tag in cmd and "computed serve" in cmd else
                "statesvc" if tag in cmd and "statesvc serve" in cmd else
                "postgres" if pg_root in cmd or cmd.startswith("postgres:") else None)
        if role is not None and not math.isnan(cpu := cpu_seconds(int(pid))):  # NaN: it ended
            out[role] += cpu
            if role != "postgres":
                for name, seconds in thread_cpu(int(pid)).items():
                    out[f"{role}/{name}"] = out.get(f"{role}/{name}", 0.0) + seconds
    return out


def measure_propagations(settings: Settings, server: PgServer,
                         root: Path) -> list[dict[str, Any]]:
    """bench_replica's propagation with the log on PostgreSQL, a new database each count,
    with the CPU each role used per load (and unload) while the loads ran: with more
    replicas than cores, their own work queues behind each other."""
    from benchmarks.bench_replica import SHAPE, adapter_specs, measure_propagation

    specs = adapter_specs(settings.loads + 1)
    example = make_example(root / "prop-example", seed=0, shape=SHAPE, adapters=specs)
    files = [example.adapter_dirs[s.name] / "adapter_model.safetensors" for s in specs]
    out: list[dict[str, Any]] = []
    for n in settings.replica_counts:
        marks: dict[str, tuple[dict[str, float], float]] = {}

        def phase(what: str, tag: str = f"prop-{n}/") -> None:
            marks[what] = (cpu_by_role(tag, str(server.root)), os.getloadavg()[0])

        p = measure_propagation(root, example.model_dir, files, n, settings.loads,
                                statesvc_args=("--db", server.database()), phase=phase)
        p.pop("samples_ms")
        p["p99_over_one"] = round(p["from_ack_ms_p99"] / (out or [p])[0]["from_ack_ms_p99"], 3)
        p["p50_over_one"] = round(p["from_ack_ms_p50"] / (out or [p])[0]["from_ack_ms_p50"], 3)
        (c0, l0), (c1, l1) = marks["loads"], marks["done"]
        p["cpu_ms_per_load"] = {r: round((c1[r] - c0[r]) / settings.loads * 1000, 1)
                                for r in ROLES}
        # by thread: a replica's threads per replica, statesvc's as they are (threads that
        # ended between the marks are missing from both, so this is the steady part)
        p["cpu_ms_per_load_by_thread"] = {
            role: {k.split("/", 1)[1]: round((c1[k] - c0.get(k, 0.0)) / settings.loads * 1000
                                             / (n if role == "replicas" else 1), 2)
                   for k in sorted(c1) if k.startswith(role + "/") and c1[k] > c0.get(k, 0.0)}
            for role in ("replicas", "statesvc")}
        p["loadavg_1m"] = [round(l0, 2), round(l1, 2)]
        out.append(p)
        console.print(f"[dim]{n} replica(s): from ack p50 {p['from_ack_ms_p50']} ms, "
                      f"p99 {p['from_ack_ms_p99']} ms ({p['p99_over_one']}x 1 replica); CPU "
                      f"ms per load {p['cpu_ms_per_load']}; by thread (a replica's per "
                      f"replica) {p['cpu_ms_per_load_by_thread']}; load {p['loadavg_1m']}[/dim]")
    return out


def _at_head(svc: StateSvc, clients: list[ControlClient], *, registered: bool = False) -> bool:
    """Every replica at statesvc's head; `registered`: and statesvc's registry says so (what
    peers are picked by)."""
    with ControlClient(svc.control, timeout_s=30) as c:
        status = c.call("status")
    head = status["head_seq"]
    active = {r["id"] for r in status["replicas"]
              if r["applied_seq"] == head and r["state"] == "ACTIVE"}
    mine = [cl.call("status") for cl in clients]
    return all(st["applied_seq"] == head and st["state"] == "ACTIVE"
               and (st["id"] in active or not registered) for st in mine)


def measure_bootstrap(settings: Settings, server: PgServer, root: Path) -> dict[str, Any]:
    """New replicas started at once beside warm ones, with peer blobs and without, interleaved
    `settings.repeats` times (module docstring)."""
    from benchmarks.bench_replica import SHAPE, adapter_specs

    base = root / "boot"
    specs = adapter_specs(settings.bootstrap_adapters)
    example = make_example(base / "example", seed=1, shape=SHAPE, adapters=specs)
    fleet = Fleet(base, example.model_dir, adapters={x.name: example.adapter_dirs[x.name] for x in specs},
                  max_loras=settings.bootstrap_adapters, max_rank=16, pool={"dtype": "float32"},
                  replicas=settings.bootstrap_warm, replica_args=("--no-inference",),
                  statesvc_args=("--db", server.database()))
    svc = fleet.svc
    runs: dict[str, list[dict[str, Any]]] = {"peers": [], "statesvc": []}
    new: list[Computed] = []
    try:
        fleet.start()
        with ExitStack() as stack:
            held = [stack.enter_context(ControlClient(r.listen, timeout_s=30, retries=0))
                    for r in fleet.replicas]
            wait_for(lambda: _at_head(svc, held, registered=True), what="the warm replicas",
                     timeout=300)
        for rep in range(settings.repeats):
            for mode in runs:
                tag = f"boot/{mode}-{rep}/"
                new = [Computed(example.model_dir, svc, base / f"{mode}-{rep}" / f"n{i}",
                                replica_id=f"{mode[0]}{rep}n{i}", extra_args=(
                                    "--no-inference",
                                    *(() if mode == "peers" else ("--no-peer-blobs",))))
                       for i in range(settings.bootstrap_new)]
                cpu0 = cpu_by_role(tag, str(server.root))
                svc_cpu0 = cpu_seconds(svc.pid)
                t0 = time.time()  # the replicas' applied_at is wall-clock time
                with ThreadPoolExecutor(len(new)) as pool:  # started together, not in turn
                    ready = dict(pool.map(lambda r: (r.start().replica_id, time.time()), new))
                with ExitStack() as stack:
                    clients = [stack.enter_context(ControlClient(r.listen, timeout_s=30,
                                                                 retries=0)) for r in new]
                    wait_for(lambda: _at_head(svc, clients), what=f"{mode} bootstrap",
                             timeout=300)
                    statuses = [cl.call("status") for cl in clients]
                wall = max(st["applied_at"] for st in statuses) - t0
                cpu1 = cpu_by_role(tag, str(server.root))
                # from a replica's READY line (its process up, its model read) to the head
                after_ready = max(st["applied_at"] - ready[st["id"]] for st in statuses)
                run = {"wall_s": round(wall, 3), "ready_to_head_s": round(after_ready, 3),
                       "statesvc_blob_fetches": sum(st["blob_fetches"] for st in statuses),
                       "peer_blob_fetches": sum(st["peer_blob_fetches"] for st in statuses),
                       "statesvc_cpu_s": round(cpu_seconds(svc.pid) - svc_cpu0, 3),
                       "postgres_cpu_s": round(cpu1["postgres"] - cpu0["postgres"], 3),
                       "replicas_cpu_s": round(cpu1["replicas"] - cpu0["replicas"], 3)}
                runs[mode].append(run)
                console.print(f"[dim]bootstrap {rep + 1}/{settings.repeats} {mode:<8} "
                              f"{run}[/dim]")
                for n in new:
                    n.stop()
                new = []
    finally:
        for r in new:
            r.stop()
        fleet.stop()
    med = {mode: {k: median([r[k] for r in rs]) for k in rs[0]} for mode, rs in runs.items()}
    return {"warm": settings.bootstrap_warm, "new": settings.bootstrap_new,
            "adapters": settings.bootstrap_adapters, "runs": runs, "median": med}
