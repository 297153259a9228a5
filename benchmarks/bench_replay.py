"""Cold replica rebuilds by replay, for logs of 1k, 10k and 100k events, next to loading directly.

    .venv/bin/python -m benchmarks.bench_replay [--sizes 1000,10000,100000] [--repeats 3] [--quick]

What it runs, and why: docs/benchmarks.md, "bench_replay.py".
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
from rich.console import Console

from benchmarks.bench_replica import SHAPE, weights_of
from benchmarks.harness import (Figure, figure, machine_info, median, output_flags, publish, spread,
    target_lines)
from computed.replica import Replica
from computed.residency.manager import pool_spec
from computed.residency.pool import MemoryPool
from shared.client import ControlClient
from shared.config import DEFAULT_SNAPSHOT_EVERY
from shared.events import PoolConfigured
from shared.fingerprint import read_model
from shared.projections import MODULES
from statesvc.tools.example import AdapterSpec, make_example
from testkit.fleet import StateSvc
from testkit.inproc import init_pool, open_service, request

TARGET_RATIO = 1.5
TARGET_SIZE = 100_000
CHURN = 8            # small adapters loaded and unloaded to grow the log
BATCH = 64           # commands per StateService.handle call while writing the log
MAX_RANK = 16
MODES = ("snapshot", "from_zero", "direct", "files")

console = Console() if sys.stdout.isatty() else Console(width=110)


@dataclass(frozen=True)
class Settings:
    sizes: tuple[int, ...]
    live: int
    repeats: int


def specs(live: int) -> tuple[list[AdapterSpec], list[AdapterSpec]]:
    live_specs = [AdapterSpec(f"live-{i:03d}", r=MAX_RANK, lora_alpha=32, target_modules=MODULES)
                  for i in range(live)]
    churn = [AdapterSpec(f"churn-{i}", r=2, lora_alpha=4, target_modules=("q_proj",))
             for i in range(CHURN)]
    return live_specs, churn


class LogWriter:
    """Grows one log through the real StateService, keeping the live set fixed at the head."""

    def __init__(self, data_dir: Path, model_dir: Path, live: dict[str, Path],
                 churn: dict[str, Path]) -> None:
        self.data_dir, self.live, self.churn = data_dir, live, churn
        service = open_service(data_dir, snapshot_every=DEFAULT_SNAPSHOT_EVERY)
        try:
            init_pool(service, model_dir, max_loras=len(live) + CHURN, max_rank=MAX_RANK)
            self._run(service, [request("load", name=n, path=str(p)) for n, p in live.items()])
        finally:
            service.store.close()
        self.i = 0

    def _run(self, service: Any, requests: list[Any]) -> int:
        for start in range(0, len(requests), BATCH):
            answers, _ = service.handle([(r, "bench") for r in requests[start:start + BATCH]])
            for a in answers:
                if a.error is not None:
                    raise RuntimeError(f"building the log failed: {a.error}")
        return int(service.store.head())

    def grow_to(self, size: int) -> int:
        """Append churn until the log holds at least `size` events; returns the head."""
        service = open_service(self.data_dir, snapshot_every=DEFAULT_SNAPSHOT_EVERY)
        try:
            head = int(service.store.head())
            names = list(self.churn)
            while head < size:
                # one round: load every churn adapter, then unload them all (2 x CHURN events)
                rounds = max(1, min(64, (size - head) // (2 * CHURN)))
                reqs = []
                for _ in range(rounds):
                    reqs += [request("load", name=n, path=str(self.churn[n])) for n in names]
                    reqs += [request("unload", name=n) for n in names]
                head = self._run(service, reqs)
            return head
        finally:
            service.store.close()


def rebuild(control: str, model_dir: Path, cache: Path, *, from_zero: bool) -> tuple[float, str]:
    """A fresh replica with an empty cache reaches the head; returns (seconds, pool digest)."""
    shutil.rmtree(cache, ignore_errors=True)
    model = read_model(model_dir)
    with ControlClient(control, timeout_s=120) as client:
        t0 = time.perf_counter()
        replica = Replica(model, client, cache, from_zero=from_zero)
        replica.bootstrap()
        assert replica.pool is not None
        jax.block_until_ready(replica.pool.arrays)
        elapsed = time.perf_counter() - t0
        return elapsed, replica.pool_digest()


def from_files(pool: PoolConfigured, live: dict[str, Path], scalings: dict[str, float]) -> float:
    """The floor: the live adapters read, parsed and written into a fresh pool, in-process."""
    t0 = time.perf_counter()
    p = MemoryPool(pool_spec(pool))
    for slot, (name, path) in enumerate(live.items()):
        p.write_slot(slot, weights_of(path / "adapter_model.safetensors", scalings[name]))
    jax.block_until_ready(p.arrays)
    return time.perf_counter() - t0


def run(settings: Settings) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="loraplane-bench-replay-"))
    load_before = os.getloadavg()[0]
    try:
        live_specs, churn_specs = specs(settings.live)
        example = make_example(root / "example", seed=0, shape=SHAPE,
                               adapters=tuple(live_specs + churn_specs))
        live = {s.name: example.adapter_dirs[s.name] for s in live_specs}
        churn = {s.name: example.adapter_dirs[s.name] for s in churn_specs}
        scalings = {s.name: s.scaling for s in live_specs}
        data_dir = root / "data"
        t0 = time.perf_counter()
        writer = LogWriter(data_dir, example.model_dir, live, churn)
        build_s = time.perf_counter() - t0
        # the direct load's log: the pool and the live loads, nothing else
        LogWriter(root / "data-direct", example.model_dir, live, churn)
        direct_svc = StateSvc(root / "data-direct").start()
        try:
            sizes = measure_sizes(settings, root, example.model_dir, writer, direct_svc,
                                  live, scalings)
        finally:
            direct_svc.stop()
        build_s += sum(row.pop("build_s") for row in sizes)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    largest = sizes[-1]
    targets = []
    if largest["events"] >= TARGET_SIZE:
        value = largest["snapshot_over_direct"]
        targets.append({"name": f"replay of {largest['events']:,} events (with snapshots) / "
                                "direct load of the live set",
                        "target": f"<= {TARGET_RATIO}x", "measured": round(value, 3),
                        "met": value <= TARGET_RATIO})
    return {"benchmark": "replay",
            "machine": {**machine_info(), "jax": jax.__version__,
                        "loadavg_1m_before": round(load_before, 2),
                        "loadavg_1m_after": round(os.getloadavg()[0], 2)},
            "settings": {"sizes": list(settings.sizes), "live": settings.live,
                         "repeats": settings.repeats, "churn_adapters": CHURN,
                         "snapshot_every": DEFAULT_SNAPSHOT_EVERY,
                         "model": {"hidden": SHAPE.hidden_size, "layers": SHAPE.num_hidden_layers,
                                   "intermediate": SHAPE.intermediate_size},
                         "live_rank": MAX_RANK, "targets": "all"},
            "log_build_s": round(build_s, 2),
            "sizes": sizes,
            "targets": targets}


def measure_sizes(settings: Settings, root: Path, model_dir: Path, writer: LogWriter,
                  direct_svc: StateSvc, live: dict[str, Path],
                  scalings: dict[str, float]) -> list[dict[str, Any]]:
    pool = _pool_of(writer.data_dir)
    from_files(pool, live, scalings)  # warm-up: compiles the pool writes
    sizes = []
    for size in settings.sizes:
        t0 = time.perf_counter()
        head = writer.grow_to(size)
        build_s = time.perf_counter() - t0
        svc = StateSvc(writer.data_dir).start()
        try:
            runs: dict[str, list[float]] = {m: [] for m in MODES}
            digests: set[str] = set()
            for r in range(settings.repeats):  # interleaved and rotated: drift hits all alike
                order = ("snapshot", "from_zero", "direct")
                for mode in order[r % 3:] + order[:r % 3]:
                    control = direct_svc.control if mode == "direct" else svc.control
                    seconds, digest = rebuild(control, model_dir, root / f"cache-{r}",
                                              from_zero=mode == "from_zero")
                    runs[mode].append(seconds)
                    digests.add(digest)
                runs["files"].append(from_files(pool, live, scalings))
        finally:
            svc.stop()
        if len(digests) != 1:
            raise RuntimeError(f"rebuilds at {head} events made different pools: {digests}")
        row: dict[str, Any] = {"events": head, "build_s": build_s, "seconds": runs,
                               **{f"{m}_s": median(v) for m, v in runs.items()}}
        for mode in ("snapshot", "from_zero", "files"):
            ratios = [a / b for a, b in zip(runs[mode], runs["direct"])]
            row[f"{mode}_over_direct"] = median(ratios)
            row[f"{mode}_over_direct_spread"] = spread(ratios)
        sizes.append(row)
        console.print(f"[dim]{head:,} events: snapshot {row['snapshot_s'] * 1e3:.0f} ms, "
                      f"from zero {row['from_zero_s'] * 1e3:.0f} ms, direct "
                      f"{row['direct_s'] * 1e3:.0f} ms, files {row['files_s'] * 1e3:.0f} ms[/dim]")
    return sizes


def _pool_of(data_dir: Path) -> PoolConfigured:
    service = open_service(data_dir)
    try:
        state = service.rebuild()
    finally:
        service.store.close()
    assert state.pool is not None
    return state.pool


def render(result: dict[str, Any]) -> str:
    cols = ("events in log", "with snapshots ms", "x direct", "without snapshots ms", "x direct",
            "direct load ms", "floor: files to pool ms")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---:|" * len(cols)]
    for row in result["sizes"]:
        lines.append(f"| {row['events']:,} | {row['snapshot_s'] * 1e3:.0f} | {row['snapshot_over_direct']:.2f} "
                     f"| {row['from_zero_s'] * 1e3:.0f} | {row['from_zero_over_direct']:.2f} "
                     f"| {row['direct_s'] * 1e3:.0f} | {row['files_s'] * 1e3:.0f} |")
    s = result["settings"]
    lines += ["", f"{s['live']} live rank-{s['live_rank']} adapters on every target module "
              f"(hidden {s['model']['hidden']}, {s['model']['layers']} layers); the rest of the "
              f"log is load/unload churn of {s['churn_adapters']} small adapters, written by the "
              f"state service ({result['log_build_s']:.0f} s for the largest log); a snapshot "
              f"every {s['snapshot_every']} events. Each rebuild is a fresh replica with an empty "
              "blob cache against a `statesvc serve` subprocess, from its first request to a "
              "ready pool. Direct: the same replica against a log that holds only the pool and "
              "the live loads (it fetches, checks, caches and writes the same adapters; the "
              "ratio is the price of the history). Floor: the adapter files read and written "
              f"into a fresh pool in-process, no service. Medians of {s['repeats']} interleaved "
              "runs; `benchmarks/results/replay.json` has every run.", ""]
    lines += target_lines(result)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--sizes", default="1000,10000,100000",
                    help="log lengths to measure, ascending, comma-separated")
    ap.add_argument("--live", type=int, default=32, help="adapters live at the head")
    ap.add_argument("--repeats", type=int, default=3)
    output_flags(ap, "replay", "a smoke run: small logs, one repeat")
    args = ap.parse_args(argv)
    settings = Settings(tuple(int(s) for s in args.sizes.split(",")), args.live, args.repeats)
    if args.quick:
        settings = Settings((200, 600), 4, 1)
    result = run(settings)
    markdown = render(result)
    console.print(markdown)
    publish("replay", result, markdown, quick=args.quick, no_write=args.no_write, say=console.print)
    return 0


def figures(r: dict[str, Any]) -> list[Figure]:
    out = []
    for row in r["sizes"]:
        n = row["events"]
        big = n >= 100_000
        for mode, label in (("snapshot", "with snapshots"), ("from_zero", "without snapshots")):
            value = row[f"{mode}_over_direct"]
            target = "<= 1.5x" if big and mode == "snapshot" else None
            out.append(figure("replay", f"replay of {n:,} events {label} / direct load of "
                                        f"{r['settings']['live']} adapters", value, "x",
                              target=target, meets=value <= 1.5 if target else None,
                              spread=row[f"{mode}_over_direct_spread"],
                              runs=len(row["seconds"][mode])))
    return out


if __name__ == "__main__":
    raise SystemExit(main())
