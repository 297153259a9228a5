"""Replica speed: a diff against a pool rebuild, propagation to 1/2/4 replicas, RSS over time.

    .venv/bin/python -m benchmarks.bench_replica [--loads 60] [--cycles 2000] [--no-write]

What it runs, and why: docs/benchmarks.md, "bench_replica.py".
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import jax
from rich.console import Console

from benchmarks.harness import (Figure, Fleet, figure, machine_info, median, output_flags, percentile, publish, spread,
                                target_lines)
from benchmarks.replica_inproc import (MAX_LORAS, MAX_RANK, RANK, SHAPE, Settings, adapter_specs, measure_pool,
                                       measure_replica, ms, timed, weights_of)
from shared.client import ControlClient
from statesvc.tools.example import make_example
from testkit.fleet import memory_kb

__all__ = ["SHAPE", "adapter_specs", "measure_propagation", "weights_of"]  # bench_pg's and bench_replay's

TARGET_DIFF_OVER_REBUILD = 1 / 20
TARGET_RSS_RATIO = 1.05
POLL_S = 0.005          # between status polls of a replica that has not applied a load yet
APPLY_TIMEOUT_S = 60.0  # a replica slower than this is broken, not slow
RSS_WINDOW = 6          # adapters loaded at once during the RSS cycles (so slots vary)
RSS_ADAPTERS = 12       # distinct adapters the RSS cycles go over
RSS_WARMUP_CYCLES = 100
SETTLE_S = 2.5          # after the replica reaches the head: its heartbeat digest has run
RSS_SAMPLES = 5         # RSS is the median of this many reads (it moves by a few MB at rest)
RSS_EVERY_S = 0.5
PROPAGATION_BLOCKS = 3  # the propagation figures are medians over this many blocks of loads

console = Console()


# ---- 2. propagation to 1, 2 and 4 computed serve processes ------------------------

def wait_applied(clients: list[ControlClient], seq: int) -> list[dict[str, Any]]:
    """Poll each replica until it reports `seq` applied; returns their statuses."""
    out = []
    deadline = time.monotonic() + APPLY_TIMEOUT_S
    for client in clients:
        while True:
            st = client.call("status")
            if st["applied_seq"] >= seq and st["state"] == "ACTIVE":
                out.append(st)
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"replica {st['id']} stuck at seq {st['applied_seq']} "
                                   f"(waiting for {seq}; last_error {st['last_error']})")
            time.sleep(POLL_S)
    return out


def measure_propagation(root: Path, model_dir: Path, adapter_files: list[Path], n: int,
                        loads: int, *, statesvc_args: tuple[str, ...] = (),
                        phase: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """`statesvc_args`: e.g. --db URL (benchmarks/bench_pg.py), one database per call;
    `phase("loads")` and `phase("done")` bracket the measured loads (CPU accounting)."""
    base = root / f"prop-{n}"
    base.mkdir(parents=True)
    fleet = Fleet(base, model_dir, max_loras=MAX_LORAS, max_rank=MAX_RANK, pool={"dtype": "float32"},
                  replicas=n, replica_args=("--no-inference",), statesvc_args=statesvc_args)
    replicas, cmd = fleet.replicas, fleet.command
    clients: list[ControlClient] = []
    try:
        fleet.start()
        clients = [ControlClient(r.listen, timeout_s=30, retries=0) for r in replicas]
        wait_applied(clients, fleet.seq)
        warm = cmd("load", name="warm", path=str(adapter_files[-1].parent))
        wait_applied(clients, warm["seq"])
        wait_applied(clients, cmd("unload", name="warm")["seq"])
        from_send: list[list[float]] = [[] for _ in replicas]
        from_ack: list[list[float]] = [[] for _ in replicas]
        unload_from_ack: list[float] = []
        acks = []
        phase("loads")
        for i in range(loads):
            t_send = time.time()
            seq = cmd("load", name=f"p{i}", path=str(adapter_files[i].parent))["seq"]
            t_ack = time.time()
            acks.append(t_ack - t_send)
            for k, st in enumerate(wait_applied(clients, seq)):
                assert st["applied_seq"] == seq, (st["applied_seq"], seq)
                from_send[k].append(st["applied_at"] - t_send)
                from_ack[k].append(st["applied_at"] - t_ack)
            seq = cmd("unload", name=f"p{i}")["seq"]
            t_ack = time.time()
            unload_from_ack += [st["applied_at"] - t_ack for st in wait_applied(clients, seq)]
        phase("done")
        fetches = [st["blob_fetches"] for st in wait_applied(clients, seq)]
    except BaseException:
        console.print(fleet.logs())
        raise
    finally:
        for client in clients:
            client.close()
        fleet.stop()
    every_send = [x for xs in from_send for x in xs]
    every_ack = [x for xs in from_ack for x in xs]
    # the loads in PROPAGATION_BLOCKS consecutive blocks: each block's percentiles, so a figure
    # is the median over blocks with their spread (every load is a new adapter, so blocks
    # cannot be rerun without the replicas' caches answering)
    size = -(-loads // PROPAGATION_BLOCKS)
    blocks = []
    for b in range(0, loads, size):
        xs = [x for per_replica in from_ack for x in per_replica[b:b + size]]
        blocks.append({"loads": len(xs) // n, "from_ack_ms_p50": ms(median(xs)),
                       "from_ack_ms_p99": ms(percentile(xs, 99))})
    slowest_send = [max(xs) for xs in zip(*from_send)]  # per load: when the last replica had it
    return {"replicas": n, "loads": loads, "blob_fetches_per_replica": fetches,
            "load_ack_ms_p50": ms(median(acks)), "load_ack_ms_p99": ms(percentile(acks, 99)),
            "from_send_ms_p50": ms(median(every_send)), "from_send_ms_p99": ms(percentile(every_send, 99)),
            "from_ack_ms_p50": ms(median(every_ack)), "from_ack_ms_p99": ms(percentile(every_ack, 99)),
            "from_ack_ms_min": ms(min(every_ack)),
            "all_replicas_from_send_ms_p50": ms(median(slowest_send)),
            "all_replicas_from_send_ms_p99": ms(percentile(slowest_send, 99)),
            "unload_from_ack_ms_p50": ms(median(unload_from_ack)),
            "per_replica_from_ack_ms_p50": [ms(median(xs)) for xs in from_ack],
            "blocks": blocks,
            "samples_ms": {"load_ack": [ms(x) for x in acks],
                           "from_ack": [[ms(x) for x in xs] for xs in from_ack]}}


def measure_read_sha(path: Path, repeats: int = 50) -> dict[str, Any]:
    def read_hash() -> None:
        hashlib.sha256(path.read_bytes()).hexdigest()

    read_hash()
    times = [timed(read_hash) for _ in range(repeats)]
    return {"file_mb": round(path.stat().st_size / 1e6, 3), "read_sha256_ms_p50": ms(median(times))}


# ---- 3. RSS of computed serve over load/unload cycles -----------------------------

def measure_rss(root: Path, model_dir: Path, adapter_files: list[Path],
                cycles: int) -> dict[str, Any]:
    base = root / "rss"
    base.mkdir(parents=True)
    fleet = Fleet(base, model_dir, max_loras=MAX_LORAS, max_rank=MAX_RANK, pool={"dtype": "float32"},
                  replica_args=("--no-inference",))
    replica, cmd = fleet.replica, fleet.command
    files = adapter_files[:RSS_ADAPTERS]
    try:
        fleet.start()
        with ControlClient(replica.listen, timeout_s=30, retries=0) as rc:
            pid = replica.pid
            loaded: list[str] = []
            done = 0

            def cycle(i: int) -> int:
                """Unload the oldest of the window when it is full, then load a new name."""
                seq = 0
                if len(loaded) >= RSS_WINDOW:
                    seq = cmd("unload", name=loaded.pop(0))["seq"]
                name = f"n{i % (2 * RSS_WINDOW)}"
                seq = cmd("load", name=name, path=str(files[i % len(files)].parent))["seq"]
                loaded.append(name)
                return int(seq)

            def settle(seq: int) -> dict[str, Any]:
                """The steady RSS at `seq`: the median of RSS_SAMPLES reads, RSS_EVERY_S apart."""
                wait_applied([rc], seq)
                time.sleep(SETTLE_S)  # the heartbeat computes the new pool digest
                rc.call("status")
                samples = []
                for _ in range(RSS_SAMPLES):
                    samples.append(memory_kb(pid, "VmRSS"))
                    time.sleep(RSS_EVERY_S)
                return {"seq": seq, "rss_kb": median(samples), "rss_kb_samples": samples,
                        "hwm_kb": memory_kb(pid, "VmHWM")}

            for i in range(RSS_WARMUP_CYCLES):  # every adapter fetched, both jits compiled
                seq = cycle(i)
            warm = settle(seq)
            t0 = time.perf_counter()
            trace = []
            events0 = seq
            for i in range(RSS_WARMUP_CYCLES, RSS_WARMUP_CYCLES + cycles):
                seq = cycle(i)
                done += 1
                if done % 250 == 0:
                    trace.append({"cycles": done, "rss_kb": memory_kb(pid, "VmRSS")})
            send_s = time.perf_counter() - t0
            wait_applied([rc], seq)
            follow_s = time.perf_counter() - t0
            after = settle(seq)
            status = rc.call("status")
    except BaseException:
        console.print(fleet.logs())
        raise
    finally:
        fleet.stop()
    return {"cycles": cycles, "events": seq - events0, "warmup_cycles": RSS_WARMUP_CYCLES,
            "adapters": len(files), "window": RSS_WINDOW,
            "rss_mb_after_warmup": round(warm["rss_kb"] / 1024, 1),
            "rss_mb_after_cycles": round(after["rss_kb"] / 1024, 1),
            "rss_ratio": round(after["rss_kb"] / warm["rss_kb"], 4),
            "peak_rss_mb": round(after["hwm_kb"] / 1024, 1),
            "rss_mb_samples_after_warmup": [round(k / 1024, 1) for k in warm["rss_kb_samples"]],
            "rss_mb_samples_after_cycles": [round(k / 1024, 1) for k in after["rss_kb_samples"]],
            "rss_mb_trace": [{"cycles": t["cycles"], "rss_mb": round(t["rss_kb"] / 1024, 1)}
                             for t in trace],
            "events_per_s_sent": round((seq - events0) / send_s, 1),
            "events_per_s_applied": round((seq - events0) / follow_s, 1),
            "blob_fetches": status["blob_fetches"], "last_error": status["last_error"]}


# ---- the run ---------------------------------------------------------------------

def run(settings: Settings) -> dict[str, Any]:
    load_before = os.getloadavg()[0]
    if load_before > 0.5 * (os.cpu_count() or 1):
        console.print(f"[yellow]load average {load_before:.1f} on {os.cpu_count()} CPUs: other "
                      "processes are busy, so the figures will be low and noisy[/yellow]")
    root = Path(tempfile.mkdtemp(prefix="loraplane-bench-replica-"))
    n_adapters = max(settings.loads, settings.replica_loads, RSS_ADAPTERS, 8) + 1
    try:
        t0 = time.perf_counter()
        specs = adapter_specs(n_adapters)
        example = make_example(root / "example", seed=0, shape=SHAPE, adapters=specs)
        files = [example.adapter_dirs[s.name] / "adapter_model.safetensors" for s in specs]
        console.print(f"[dim]temp dir {root}; {n_adapters} rank-{RANK} adapters of "
                      f"{files[0].stat().st_size / 1e6:.2f} MB written in "
                      f"{time.perf_counter() - t0:.1f} s[/dim]")
        pool = measure_pool(settings, files, specs[0].scaling)
        console.print(f"[dim]pool {pool['pool_mb']} MB ({MAX_LORAS} slots of "
                      f"{pool['slot_mb']} MB); "
                      f"write {pool['write_ms_p50']} ms, rebuild {pool['rebuild_ms_p50']} ms[/dim]")
        replica = measure_replica(settings, root, example.model_dir, files)
        console.print(f"[dim]Replica.apply_events load: {replica['apply_load_cold_ms_p50']} ms "
                      f"(blob fetched), {replica['apply_load_cached_ms_p50']} ms (cached)[/dim]")
        propagation = []
        for n in settings.replica_counts:
            p = measure_propagation(root, example.model_dir, files, n, settings.loads)
            propagation.append(p)
            console.print(f"[dim]{n} replica(s): from ack p50 {p['from_ack_ms_p50']} ms, "
                          f"p99 {p['from_ack_ms_p99']} ms[/dim]")
        read_sha = measure_read_sha(files[0])
        rss = measure_rss(root, example.model_dir, files, settings.cycles)
        console.print(f"[dim]RSS {rss['rss_mb_after_warmup']} MB -> "
                      f"{rss['rss_mb_after_cycles']} MB "
                      f"after {rss['events']} events[/dim]")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    targets = [
        {"name": "one load diff / pool rebuild (computed.residency.pool)",
         "target": f"<= {TARGET_DIFF_OVER_REBUILD:.3f}", "measured": pool["write_over_rebuild"],
         "met": pool["write_over_rebuild"] <= TARGET_DIFF_OVER_REBUILD},
        {"name": f"RSS after {rss['events']:,} events / after warm-up",
         "target": f"<= {TARGET_RSS_RATIO}", "measured": rss["rss_ratio"],
         "met": rss["rss_ratio"] <= TARGET_RSS_RATIO},
    ]
    return {
        "benchmark": "replica",
        "machine": {**machine_info(), "jax": jax.__version__,
                    "jax_backend": jax.default_backend(),
                    "loadavg_1m_before": round(load_before, 2),
                    "loadavg_1m_after": round(os.getloadavg()[0], 2)},
        "settings": {"model": {"hidden": SHAPE.hidden_size, "intermediate": SHAPE.intermediate_size,
                               "layers": SHAPE.num_hidden_layers,
                               "heads": SHAPE.num_attention_heads,
                               "kv_heads": SHAPE.num_key_value_heads, "head_dim": SHAPE.head_dim},
                     "max_loras": MAX_LORAS, "max_rank": MAX_RANK, "adapter_rank": RANK,
                     "targets": "all", "dtype": "float32", "poll_s": POLL_S,
                     "write_iters": settings.write_iters, "rebuild_iters": settings.rebuild_iters,
                     "loads": settings.loads, "replica_counts": list(settings.replica_counts),
                     "cycles": settings.cycles},
        "pool": pool,
        "replica_apply": replica,
        "propagation": propagation,
        "read_sha256": read_sha,
        "rss": rss,
        "targets": targets,
    }


def render(result: dict[str, Any]) -> str:
    """The bench:replica section (docs/results-detail.md): the figures as markdown tables, the verdicts, the machine."""
    pool, rep = result["pool"], result["replica_apply"]
    rss, sha = result["rss"], result["read_sha256"]
    parts = rep["parts_ms_p50"]
    rows1 = [
        ("one load diff, computed.residency.pool write_slot", f"{pool['write_ms_p50']:.2f}",
         f"p99 {pool['write_ms_p99']:.2f}; host padding {pool['host_pad_ms_p50']:.2f}; "
         f"buffers in place: {'yes' if pool['buffers_in_place'] else 'NO'}"),
        ("one unload diff, computed.residency.pool clear_slot", f"{pool['clear_ms_p50']:.2f}", ""),
        (f"rebuild: new MemoryPool + {MAX_LORAS} writes", f"{pool['rebuild_ms_p50']:.1f}",
         f"allocation alone {pool['alloc_only_ms_p50']:.1f}; one write / this "
         f"{pool['write_over_rebuild']:.4f}"),
        ("one load, Replica.apply_events, blob fetched", f"{rep['apply_load_cold_ms_p50']:.2f}",
         f"p99 {rep['apply_load_cold_ms_p99']:.2f}"),
        ("one load, Replica.apply_events, blob cached", f"{rep['apply_load_cached_ms_p50']:.2f}",
         f"p99 {rep['apply_load_cached_ms_p99']:.2f}"),
        ("one unload, Replica.apply_events", f"{rep['apply_unload_ms_p50']:.2f}", ""),
        ("  part: blob fetch over ZeroMQ, with its sha256 check",
         f"{parts['blob_fetch_over_zmq']:.2f}", ""),
        ("  part: cache read + sha256", f"{parts['cache_read_and_sha256']:.2f}", ""),
        ("  part: safetensors parse", f"{parts['parse_safetensors']:.2f}", ""),
        ("  part: pool write", f"{parts['pool_write']:.2f}", ""),
        ("  part: local state save", f"{parts['save_local_state']:.2f}", ""),
        (f"replica rebuilt by replay, {MAX_LORAS} slots, blobs fetched",
         f"{rep['replay_64_slots_blobs_fetched_ms']:.1f}",
         f"one load fetched / this {rep['apply_cold_over_replay_cold']:.3f}"),
        (f"replica rebuilt by replay, {MAX_LORAS} slots, blobs cached",
         f"{rep['replay_64_slots_blobs_cached_ms_p50']:.1f}",
         f"one load cached / this {rep['apply_cached_over_replay_cached']:.3f}"),
        ("pool digest (status, heartbeat)", f"{pool['pool_digest_ms_p50']:.1f}", ""),
    ]
    cols2 = ("replicas", "from ack p50", "from ack p99", "from send p50", "from send p99",
             "last replica from send p99", "ack p50", "ack p99")
    lines = ["| measurement | median ms | notes |", "|---|---:|---|"]
    lines += [f"| {a.strip()} | {b} | {c} |" for a, b, c in rows1]
    lines += ["", f"Propagation of a load to `computed serve` processes, ms "
              f"({result['settings']['loads']} distinct adapters, each fetched by every replica; "
              "from send/ack: the replica's `applied_at` minus when `load` was sent / answered; "
              "ack: the `load` round trip):",
              "", "| " + " | ".join(cols2) + " |", "|" + "---:|" * len(cols2)]
    for p in result["propagation"]:
        cells = [str(p["replicas"]), f"{p['from_ack_ms_p50']:.1f}", f"{p['from_ack_ms_p99']:.1f}",
                 f"{p['from_send_ms_p50']:.1f}", f"{p['from_send_ms_p99']:.1f}",
                 f"{p['all_replicas_from_send_ms_p99']:.1f}", f"{p['load_ack_ms_p50']:.1f}",
                 f"{p['load_ack_ms_p99']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append(f"\nReading and sha256-ing the same {sha['file_mb']} MB "
                 "adapter_model.safetensors: "
                 f"{sha['read_sha256_ms_p50']:.2f} ms (median).")
    lines.append(f"\nRSS of one `computed serve`: {rss['rss_mb_after_warmup']} MB after warm-up, "
                 f"{rss['rss_mb_after_cycles']} MB after {rss['cycles']:,} load/unload cycles "
                 f"({rss['events']:,} events over {rss['adapters']} adapters), peak "
                 f"{rss['peak_rss_mb']} MB; the replica applied {rss['events_per_s_applied']:,} "
                 "events/s.\n")
    lines += target_lines(result)
    m = result["machine"]
    lines.append(f"\n{m['nproc']} CPUs, Python {m['python']}, JAX {m['jax']} "
                 f"({m['jax_backend']}), load average {m['loadavg_1m_before']} before and "
                 f"{m['loadavg_1m_after']} after, {m['date']}; "
                 "`python -m benchmarks.bench_replica` reproduces it.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--write-iters", type=int, default=100, help="single slot writes timed")
    ap.add_argument("--rebuild-iters", type=int, default=7, help="whole pool rebuilds timed")
    ap.add_argument("--replica-loads", type=int, default=20,
                    help="loads applied in-process through Replica.apply_events (each twice)")
    ap.add_argument("--loads", type=int, default=60, help="loads per propagation measurement")
    ap.add_argument("--replicas", default="1,2,4", help="replica counts, comma-separated")
    ap.add_argument("--cycles", type=int, default=10000, help="load/unload cycles for the RSS")
    output_flags(ap, "replica", "a smoke run: a few iterations of everything, one replica")
    a = ap.parse_args(argv)
    settings = Settings(a.write_iters, a.rebuild_iters, a.replica_loads, a.loads,
                        tuple(int(x) for x in a.replicas.split(",")), a.cycles)
    if a.quick:
        settings = Settings(write_iters=10, rebuild_iters=2, replica_loads=3, loads=5,
                            replica_counts=(1,), cycles=40)
    t0 = time.perf_counter()
    result = run(settings)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    markdown = render(result)
    console.print(markdown)
    console.print(f"RSS every 250 cycles: {[t['rss_mb'] for t in result['rss']['rss_mb_trace']]}; "
                  f"{result['seconds']} s in all")
    publish("replica", result, markdown, quick=a.quick, no_write=a.no_write, say=console.print)
    return 0


def figures(r: dict[str, Any]) -> list[Figure]:
    out = []
    floor = r["read_sha256"]["read_sha256_ms_p50"]
    for p in r["propagation"]:
        n = p["replicas"]
        for q in ("p50", "p99"):
            # per block of loads where the results have blocks (one run of all loads otherwise)
            per_block = [b[f"from_ack_ms_{q}"] / floor for b in p.get("blocks", [])]
            value = median(per_block) if per_block else p[f"from_ack_ms_{q}"] / floor
            target = "<= 2x" if q == "p99" else None
            out.append(figure("replica", f"propagation to {n} replica(s), ack to applied {q} / "
                                         "read+sha256 of the file", value, "x", target=target,
                              meets=value <= 2 if target else None,
                              spread=spread(per_block) if per_block else None,
                              runs=len(per_block) or 1))
    pool = r["pool"]
    ratio = pool["write_over_rebuild"]
    out.append(figure("replica", "one slot write / pool rebuild", ratio, "x", target="<= 0.05x",
                      meets=ratio <= 0.05, spread=pool.get("write_over_rebuild_spread"),
                      runs=pool["rebuild_iters"]))
    if "compiles_during_writes" in pool:
        n = pool["compiles_during_writes"]
        out.append(figure("replica", "compilations during slot writes and clears", n, "compiles",
                          target="0", meets=n == 0, runs=pool["write_iters"]))
    if "bytes_over_formula" in pool:
        out.append(figure("replica", "pool bytes / formula from its shapes",
                          pool["bytes_over_formula"], "x", target="1.0x",
                          meets=abs(pool["bytes_over_formula"] - 1) < 1e-9))
    rss = r["rss"]
    out.append(figure("replica", f"RSS after {rss['cycles']:,} load/unload cycles / after warm-up",
                      rss["rss_ratio"], "x", target="<= 1.05x", meets=rss["rss_ratio"] <= 1.05,
                      spread=spread([s / rss["rss_mb_after_warmup"]
                                      for s in rss["rss_mb_samples_after_cycles"]]),
                      runs=len(rss["rss_mb_samples_after_cycles"])))
    return out


if __name__ == "__main__":
    sys.exit(main())
