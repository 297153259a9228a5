"""`make bench`: every benchmark, then one figures file, plots, the table of figures and the README's headline.

Runs each benchmark as its own process (so one's JAX threads, caches and
memory never colour the next), in the order of BENCHES. Each writes its full
results to `RESULTS/NAME.json` and its section of docs/results-detail.md; this module then reads
those files and writes

* `RESULTS/latest.json`: `{machine, date, figures: [{name, value, unit,
  target, meets, spread, runs, bench}]}`, one figure per headline ratio or
  rate, each the median of the benchmark's repeated runs with `spread`
  = [min, max] over them (null where the benchmark ran it once);
* `RESULTS/plots/*.png` (matplotlib);
* the table of every figure between docs/results.md's `bench:summary` markers, and a few of
  them (`HEADLINE`: beside vLLM, llama.cpp and PEFT) between the README's `bench:headline` ones.

`--quick` is a smoke run of the whole pipeline (tiny settings, one repeat); it
writes into `--out` (default: a fresh temp dir) and copies of README.md and docs/results*.md there,
never into the repository. `make test` runs it once so the suite cannot rot.

    .venv/bin/python -m benchmarks [--quick [--jobs 2]] [--only events,replay] [--skip vllm] [--out DIR]
        [--collect-only] [--isa avx2]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from benchmarks import plots
from benchmarks.report import (DETAIL_DOC, OUT_ENV, README, RESULTS_DIR, RESULTS_DOC, decode_rates,
                               forced_isa_env, machine_info, median, spread, update_readme)

Figure = dict[str, Any]


@dataclass(frozen=True)
class Bench:
    name: str
    module: str
    quick: tuple[str, ...]  # arguments for a smoke run
    isa_bound: bool = False  # its figures depend on the ISA the kernels are built for
    # a figure times what a cold start compiles: never run with a JAX persistent compilation
    # cache (the one `make test` gives the processes it starts, tests/conftest.py)
    cold_compiles: bool = False


BENCHES = (
    Bench("events", "benchmarks.bench_events", ("--quick",)),
    Bench("pg", "benchmarks.bench_pg", ("--quick",)),  # no results where PostgreSQL is missing
    Bench("replica", "benchmarks.bench_replica", ("--quick",)),
    Bench("replay", "benchmarks.bench_replay", ("--quick",)),
    Bench("decode", "benchmarks.bench_decode", ("--quick",), isa_bound=True),
    Bench("dtype", "benchmarks.bench_dtype", ("--quick",), isa_bound=True),
    # decode per model family: 16 adapters / base, ours / PEFT, over Llama's (issue 38)
    Bench("families", "benchmarks.bench_families", ("--quick",), isa_bound=True),
    Bench("residency", "benchmarks.bench_residency", ("--quick",), cold_compiles=True),
    Bench("gateway", "benchmarks.bench_gateway", ("--quick",)),
    # a good client beside slow connections and a flood of oversized prompts (issue 50)
    Bench("hostile", "benchmarks.bench_gateway_hostile", ("--quick",)),
    Bench("tp", "benchmarks.bench_tp", ("--quick",)),  # forced CPU devices: overhead, not speed-up
    # llama.cpp beside ours; a forced AVX2 run pairs our AVX2 kernels with an AVX2 build of the peer
    Bench("peer", "benchmarks.bench_peer_llamacpp", ("--quick",), isa_bound=True),
    # the prefix cache and chunked prefill, each beside itself switched off (issue 41)
    Bench("prefix", "benchmarks.bench_prefix", ("--quick",), isa_bound=True),
    # a real model's geometry (Qwen2.5-0.5B, bf16) against this machine's floors; startup (issue 48)
    Bench("shapes", "benchmarks.bench_shapes", ("--quick",), isa_bound=True),
    # vLLM's CPU server beside our fleet, both through the OpenAI API (issue 39); `--skip vllm`
    Bench("vllm", "benchmarks.bench_peer_vllm", ("--quick",)),
)

# `--isa avx2` (a forced AVX2+FMA build on any x86 CPU) keeps its results here, beside the
# native run's, and latest.json carries the figures of both, each with its CPU and ISA
FORCED = "avx2"


def isa_label(isas: list[str] | None) -> str:
    """The widest vector ISA the kernels were built for, as a reader names it."""
    have = set(isas or [])
    if "avx512f" in have:
        return "AVX-512" + (" (BF16)" if "avx512bf16" in have else "")
    if "avx2" in have:
        return "AVX2+FMA" if "fma" in have else "AVX2"
    return next(iter(sorted(have)), "no vector ISA").upper()


# ---- figures from each benchmark's results --------------------------------------------

def figure(bench: str, name: str, value: float, unit: str, *, target: str | None = None,
           meets: bool | None = None, spread: list[float] | None = None,
           runs: int = 1) -> Figure:
    return {"name": name, "value": round(float(value), 4), "unit": unit, "target": target,
            "meets": meets, "spread": None if spread is None else [round(v, 4) for v in spread],
            "runs": runs, "bench": bench}


def events_figures(r: dict[str, Any]) -> list[Figure]:
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


def pg_figures(r: dict[str, Any]) -> list[Figure]:
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


def replica_figures(r: dict[str, Any]) -> list[Figure]:
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


def replay_figures(r: dict[str, Any]) -> list[Figure]:
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


def decode_figures(r: dict[str, Any]) -> list[Figure]:
    """The benchmark's own ratios (medians of per-round ratios, with their spread), so the
    table and the benchmark's section agree."""
    results = r["results"]
    steps, batch = r["settings"]["steps"], r["settings"]["batch"]
    base = decode_rates(results["0"]["decode"], batch * steps)
    out = [figure("decode", "decode, base model, batch 32", median(base), "tokens/s",
                  spread=spread(base), runs=len(base))]
    if "over_loop" in results["0"]["decode"]:  # the dense kernel and attention alone: no LoRA terms
        out.append(figure("decode", "decode, base model: ours / XLA only (no native kernels)",
                          results["0"]["decode"]["over_loop"], "x",
                          spread=results["0"]["decode"].get("over_loop_spread"), runs=len(base)))
    for k in sorted(results, key=int):
        if k == "0":
            continue
        ours = results[k]["decode"]
        runs = len(decode_rates(ours, batch * steps))
        label = f"{k} distinct adapter{'s' if k != '1' else ''}"
        for key, name, goal in (("base", "/ base model", 0.75),
                                ("peft", ": ours / PEFT mixed batch", 3.0),
                                ("loop", ": ours / XLA only (no native kernels)", None),
                                ("gather", ": ours / per-token gather (BGMV-style)", None)):
            if f"over_{key}" not in ours:
                continue
            value = ours[f"over_{key}"]
            target = f">= {goal:g}x" if goal is not None and k == "16" else None
            out.append(figure("decode", f"decode, {label} {name}".replace(" :", ":"), value, "x",
                              target=target, meets=value >= goal if target and goal else None,
                              spread=ours.get(f"over_{key}_spread"), runs=runs))
    served = r.get("served") or {}
    for k in sorted(served, key=int):
        cell = served[k]
        runs = len(cell["seconds"]) if cell.get("used_rounds") is None else len(cell["used_rounds"])
        label = "base model" if k == "0" else f"{k} distinct adapter{'s' if k != '1' else ''}"
        if k == "0":
            out.append(figure("decode", "served, base model, batch 32", cell["tokens_per_s"], "tokens/s",
                              spread=cell["tokens_per_s_spread"], runs=runs))
        for key, name, goal in (("base", "/ served base", 0.75), ("peft", "/ PEFT mixed batch", 3.0),
                                ("engine", "/ in-process Engine.step, the same requests", 0.9)):
            if k == "0" and key == "base" or f"over_{key}" not in cell:
                continue
            value = cell[f"over_{key}"]
            target = f">= {goal:g}x" if k == "16" else None
            out.append(figure("decode", f"served, {label} {name}", value, "x", target=target,
                              meets=value >= goal if target else None,
                              spread=cell.get(f"over_{key}_spread"), runs=runs))
    lc = r.get("long_context")
    if lc:
        out.append(figure("decode", f"decode, base model from position {lc['start']} of {lc['max_len']}: "
                          "attention kernel / XLA attention", lc["kernel_over_xla"], "x",
                          spread=lc["kernel_over_xla_spread"], runs=len(lc["kernel"]["seconds"])))
    return out


def dtype_figures(r: dict[str, Any]) -> list[Figure]:
    """bfloat16 model over float32 model, in process and served (issue 15: served >= 1.0x)."""
    out = []
    for path, label in (("decode", "decode"), ("served", "served")):
        for k, cell in r[path].items():
            mix = "base model" if k == "0" else f"{k} distinct adapters"
            target = cell.get("target")
            out.append(figure("dtype", f"{label}, {mix}: bfloat16 model / float32 model", cell["bf16_over_f32"], "x",
                              target=None if target is None else f">= {target}x", meets=cell.get("pass"),
                              spread=cell["bf16_over_f32_spread"], runs=r["settings"]["repeats"]))
    return out


def residency_figures(r: dict[str, Any]) -> list[Figure]:
    """Issue 16: a Zipf stream over a registry far larger than the slots (bench_residency)."""
    t, out = r["targets"], []
    n = r["settings"]["adapters"]
    for st in r["streams"]:
        k = st["slots"]
        v = st["throughput_ratio"]
        runs = st.get("throughput_ratio_runs")
        out.append(figure("residency", f"Zipf stream over {n:,} adapters, {k} slots / all "
                          "resident", v, "x", target=f">= {t['throughput']}x",
                          meets=v >= t["throughput"], spread=spread(runs) if runs else None,
                          runs=len(runs) if runs else 1))
        waited = "waited" in st.get("open", {})  # results from before the in-run measure
        for tier, label in (("host", "host-tier hit"), ("miss", "miss")):
            c = st.get("open", {}).get("waited", {}).get(tier, {})
            if "p99_over_floor" in c:  # what non-residency adds, within the run (the target)
                v = c["p99_over_floor"]
                out.append(figure("residency", f"added TTFT p99 (residency wait in the run), "
                                  f"{label}, {k} slots / its fill floor", v, "x",
                                  target=f"<= {t['ttft_p99']}x", meets=v <= t["ttft_p99"],
                                  runs=st.get("rounds", 1)))
            c = st.get("open", {}).get("added", {}).get(tier, {})
            if "p99_over_floor" in c:  # the same, as paired runs' TTFT differences (noisier:
                v = max(0.0, c["p99_over_floor"])  # runs differ by whole decode steps)
                out.append(figure("residency", f"added TTFT p99, {label}, {k} slots / its fill "
                                  "floor" + (", paired runs" if waited else ""), v, "x",
                                  target=None if waited else f"<= {t['ttft_p99']}x",
                                  meets=None if waited else v <= t["ttft_p99"],
                                  runs=st.get("rounds", 1)))
            c = st.get("open", {}).get("added_no_wait", {}).get(tier, {})
            if "p99_over_floor" in c:  # the same without the step's wait for a fetch
                out.append(figure("residency", f"added TTFT p99, {label}, {k} slots / its fill "
                                  "floor, without waiting for fetches (before)",
                                  max(0.0, c["p99_over_floor"]), "x", runs=st.get("rounds", 1)))
            c = st[f"ttft_{tier}"]
            if "p99_over_floor" in c:  # literal: queueing + prefill in a closed loop of 32
                v = c["p99_over_floor"]
                out.append(figure("residency", f"literal TTFT p99 (closed loop, queue + prefill), "
                                  f"{label}, {k} slots / its fill floor", v, "x",
                                  target=f"<= {t['ttft_p99']}x", meets=v <= t["ttft_p99"]))
        out.append(figure("residency", f"host-tier hit rate, {k} slots",
                          100 * st["host_hit_rate"], "%"))
        out.append(figure("residency", f"evictions per 1,000 requests, {k} slots",
                          st["evictions_per_1000"], "evictions"))
    rss, cold = r["rss"], r["cold"]
    out.append(figure("residency", f"replica RSS, {rss['many']:,} / {rss['few']} registered",
                      rss["ratio"], "x", target=f"<= {t['rss']}x", meets=rss["ratio"] <= t["rss"],
                      spread=spread(rss["ratio_runs"]) if "ratio_runs" in rss else None,
                      runs=len(rss.get("ratio_runs", [1]))))
    out.append(figure("residency", f"cold replica to ACTIVE, {cold['many']:,} / {cold['few']} "
                      "registered", cold["ratio"], "x", target=f"<= {t['cold']}x",
                      meets=cold["ratio"] <= t["cold"], runs=len(cold["many_s"])))
    if "bootstrap_ratio" in cold:
        out.append(figure("residency", f"cold bootstrap in process, {cold['many']:,} / "
                          f"{cold['few']} registered", cold["bootstrap_ratio"], "x",
                          runs=len(cold["many_s"])))
    return out
def gateway_figures(r: dict[str, Any]) -> list[Figure]:
    """The gateway with streaming over ZeroMQ straight to the replica (issue 17): the targets
    on the decode benchmark's model (`bench`), the tiny example model's figures for context
    (the gateway's worst case). The added-latency target is the steady stream's (32 streams
    in a closed loop): a burst's requests, all sent at once, queue behind one another on the
    gateway's one event loop, a figure reported beside it (docs/gateway.md)."""
    out = []
    shapes = r.get("shapes") or {"": r}  # results from before the two shapes: one, targeted
    for shape, s in shapes.items():
        i = 0 if shape == r.get("shape", "bench") or shape == "" else 1  # 0: the targets apply
        rows, runs = s["rounds_detail"], s["rounds"]
        # within each request: its latency less the gateway's upstream time for it
        # (results from before that measure: the end-to-end difference, run to run)
        inside = "outside_p50_ms" in rows[0]["gateway"]
        added = {q: [x["gateway"][f"outside_{q}_ms"] if inside
                     else x["gateway"][f"{q}_ms"] - x["zmq"][f"{q}_ms"] for x in rows]
                 for q in ("p50", "p99")}
        where = {"split": ", gateway on its own CPU", "shared": ", all on all CPUs"}.get(
            s.get("layout", ""), "")  # results from before the layouts: all on all CPUs
        on = f" ({s.get('shape', shape)} model{where})" if shape else ""
        steady = s.get("steady") or {}
        burst = " in a burst of 32" if steady.get("rounds") else ""
        out.append(figure("gateway", f"gateway + streaming / ZeroMQ, batch 32, 16 adapters{on}",
                          s["ratio"], "x", target=">= 0.9x" if i == 0 else None,
                          meets=s["ratio"] >= 0.9 if i == 0 else None,
                          spread=s["ratio_range"], runs=runs))
        if steady.get("rounds"):
            st = [x["gateway"]["outside_p50_ms"] for x in steady["rounds_detail"]]
            st99 = [x["gateway"]["outside_p99_ms"] for x in steady["rounds_detail"]]
            # every round under the limit, not only the median
            out += [figure("gateway", f"gateway: added latency per request, steady 32 streams, "
                           f"p50{on}", steady["added_p50_ms"], "ms",
                           target="< 2" if i == 0 else None,
                           meets=max(st) < 2 if i == 0 else None, spread=spread(st),
                           runs=steady["rounds"]),
                    figure("gateway", f"gateway: added latency per request, steady 32 streams, "
                           f"p99{on}", steady["added_p99_ms"], "ms", spread=spread(st99),
                           runs=steady["rounds"])]
        out += [figure("gateway", f"gateway: added latency per request{burst}, p50{on}",
                       s["added_p50_ms"], "ms",
                       target="< 2" if i == 0 and not burst else None,
                       meets=max(added["p50"]) < 2 if i == 0 and not burst else None,
                       spread=spread(added["p50"]), runs=runs),
                figure("gateway", f"gateway: added latency per request{burst}, p99{on}",
                       s["added_p99_ms"], "ms", spread=spread(added["p99"]), runs=runs)]
        if "lone" in s:  # one request at a time: the hop alone, no burst to queue behind
            lone = s["lone"]
            out += [figure("gateway", f"gateway: added latency per lone request, {q}{on}",
                           lone[f"added_{q}_ms"], "ms", runs=lone["requests"])
                    for q in ("p50", "p99")]
    return out


def peer_figures(r: dict[str, Any]) -> list[Figure]:
    """Ours over llama.cpp on the same batches (issue 20); none when the peer was not built."""
    if r.get("peer") != "built":
        return []
    runs = r["settings"]["repeats"]
    out = []
    for key, cell in r["workloads"].items():
        k, dtype = cell["adapters"], "bfloat16" if cell["dtype"] == "bf16" else "float32"
        mix = "base model" if k == 0 else f"{k} distinct adapters"
        goal = 1.0 if k == 0 else 3.0
        if k == 0 and dtype == "float32":
            out.append(figure("peer", "llama.cpp decode, base model, batch 32", cell["llamacpp"]["tokens_per_s"],
                              "tokens/s", spread=cell["llamacpp"]["spread"], runs=runs))
        out.append(figure("peer", f"decode, {mix}, {dtype}: ours / llama.cpp", cell["ours_over_llamacpp"], "x",
                          target=f">= {goal:g}x", meets=cell["ours_over_llamacpp"] >= goal,
                          spread=cell["ours_over_llamacpp_spread"], runs=runs))
    out.append(figure("peer", "llama.cpp decode, 16 distinct adapters / its base model",
                      r["llamacpp_adapters_over_base"], "x", spread=r["llamacpp_adapters_over_base_spread"], runs=runs))
    return out


def vllm_figures(r: dict[str, Any]) -> list[Figure]:
    """Our fleet over vLLM's CPU server, same requests through the OpenAI API (issue 39): the
    bench's targets, the closed loop's ratio, vLLM's own rate, greedy agreement and startup;
    none when the peer was not installed."""
    if r.get("peer") != "installed":
        return []
    runs, cells = r["settings"]["rounds"], r["workloads"]
    out = [figure("vllm", t["name"], cells[t["workload"]][t["stat"]], "x", target=t["target"], meets=t["met"],
                  spread=cells[t["workload"]][t["stat"] + "_spread"], runs=runs) for t in r["targets"]]
    closed = cells["closed"]
    out += [figure("vllm", f"tokens/s, {closed['label']}: ours / vLLM", closed["ours_over_vllm"], "x",
                   spread=closed["ours_over_vllm_spread"], runs=runs),
            figure("vllm", f"vLLM CPU server, {cells['adapters']['label']}", cells["adapters"]["vllm"]["tok_s"],
                   "tokens/s", spread=cells["adapters"]["vllm"]["tok_s_spread"], runs=runs)]
    out += [figure("vllm", f"greedy tokens agreeing with vLLM, {w} burst", 100 * a["positions"], "%")
            for w, a in r["agreement"].items()]
    out += [figure("vllm", f"startup to healthy, {'ours' if side == 'ours' else 'vLLM'}", s, "s")
            for side, s in r["startup_s"].items()]
    return out


def hostile_figures(r: dict[str, Any]) -> list[Figure]:
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


def prefix_figures(r: dict[str, Any]) -> list[Figure]:
    """Issue 41: the prefix cache's TTFT and throughput, chunked prefill's inter-token p99, each
    with / without in the same rounds (bench_prefix); and the cached run's hit rate."""
    runs = r["settings"]["rounds"]
    out = [figure("prefix", t["name"], t["measured"], "x", target=t["target"], meets=t["met"],
                  spread=spread(r["ratios"][t["ratio"]]), runs=runs) for t in r["targets"]]
    on = [x["on"] for x in r["rounds"]["sessions"]]
    out.append(figure("prefix", "shared system prompt, prompt tokens served from the prefix cache",
                      100 * median([x["hit_tokens"] / x["prompt_tokens"] for x in on]), "%", runs=runs))
    return out


def families_figures(r: dict[str, Any]) -> list[Figure]:
    """Per family (issue 38): decode tokens/s on 16 adapters, 16 adapters / its base model, ours /
    PEFT on the same batch, and the family's 16 adapters / base over Llama's (target >= 0.9x)."""
    out, steps, batch = [], r["settings"]["steps"], r["settings"]["batch"]
    k = r["adapters"]["count"]
    for name, c in r["families"].items():
        rates = decode_rates(c["adapters"], batch * steps)
        label = f"decode, {name}, {k} distinct adapters"
        out += [figure("families", label, median(rates), "tokens/s", spread=spread(rates), runs=len(rates)),
                figure("families", f"{label} / base model", c["over_base"], "x", spread=c["over_base_spread"],
                       runs=len(rates)),
                figure("families", f"{label}: ours / PEFT mixed batch", c["over_peft"], "x",
                       spread=c["over_peft_spread"], runs=len(rates))]
    for t in r["targets"]:
        out.append(figure("families", f"decode, {t['name']}", t["measured"], "x", target=t["target"],
                          meets=t["met"]))
    return out


def tp_figures(r: dict[str, Any]) -> list[Figure]:
    """Issue 19: bytes per device against the formula, decode beside N = 1 (forced CPU devices)."""
    out = []
    for k, c in r["results"].items():
        if k == "1":
            continue
        worst = max(max(c[f"{w}_bytes_per_device"]) / c[f"{w}_formula"] for w in ("weights", "pool"))
        out.append(figure("tp", f"tensor-parallel {k}: bytes per device / formula (weights and pool)",
                          worst, "x", target="1.0x", meets=c["exact"]))
        out.append(figure("tp", f"tensor-parallel {k} on forced CPU devices: decode, 16 adapters / N = 1",
                          c["over_one"], "x", spread=c["over_one_spread"], runs=len(c["tokens_per_s"])))
    return out


def shapes_figures(r: dict[str, Any]) -> list[Figure]:
    """Issue 48, at a real geometry (bench_shapes): decode beside the weights-read floor, prefill
    beside the dense kernel's GEMM rate, first start and restart until ready, RSS unexplained.
    Each names the preset and the CPU's matrix ISA."""
    f, where = r["figures"], f"{r['preset']}, {r['machine'].get('matrix_isa', '?')}"
    out = []
    for mix in ("base", "16 adapters"):
        d, runs = f[f"decode {mix}"], len(r["decode_s"][mix])
        out.append(figure("shapes", f"decode {where}, batch 32, {mix}", d["tokens_s"], "tokens/s", runs=runs))
        out.append(figure("shapes", f"decode {where}, batch 32, {mix}: step / weights-read floor",
                          d["over_weights_floor"], "x", target="<= 1.5x", meets=d["over_weights_floor"] <= 1.5,
                          runs=runs))
    p = f["prefill"]
    if "of_gemm_peak" in p:
        out.append(figure("shapes", f"prefill {where}, 256 tokens: FLOP/s / the dense kernel's at 256 rows",
                          100 * p["of_gemm_peak"], "%", target=">= 50", meets=p["of_gemm_peak"] >= 0.5,
                          runs=len(r["prefill_s"])))
    for which, limit in (("first start", 60), ("restart", 15)):
        out.append(figure("shapes", f"replica {which} until ready, {where}", f[which]["seconds"], "s",
                          target=f"<= {limit}", meets=f[which]["seconds"] <= limit))
    out.append(figure("shapes", f"replica RSS unexplained by its parts, {where}", f["restart"]["unexplained_gb"],
                      "GB", target="<= 1", meets=f["restart"]["unexplained_gb"] <= 1))
    return out


FIGURES: dict[str, Callable[[dict[str, Any]], list[Figure]]] = {
    "events": events_figures, "pg": pg_figures, "replica": replica_figures,
    "replay": replay_figures, "decode": decode_figures, "dtype": dtype_figures,
    "families": families_figures, "residency": residency_figures, "gateway": gateway_figures,
    "hostile": hostile_figures,
    "peer": peer_figures, "prefix": prefix_figures,
    "tp": tp_figures, "vllm": vllm_figures, "shapes": shapes_figures}


# ---- the README table -------------------------------------------------------------------

def _num(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"


def verdict(f: Figure) -> str:
    if f["meets"] is None:
        return ""
    if f["meets"]:
        return "PASS"
    return f"MISS ({shortfall(f)})"


def shortfall(f: Figure) -> str:
    """How far a missed figure is from its target, in the target's own terms."""
    target = str(f["target"]).replace(",", "").rstrip("x")
    op, _, bound = target.rpartition(" ")
    try:
        goal = float(bound)
    except ValueError:
        return f"measured {_num(f['value'])}, target {f['target']}"
    if goal == 0:
        return f"{_num(f['value'])} instead of 0"
    if op == ">=":
        return f"{f['value'] / goal:.0%} of the target"
    if f["value"] < goal and f["spread"]:  # a target that every run must meet
        return f"the median is under it, runs up to {_num(f['spread'][1])}"
    return f"{f['value'] / goal:.1f}x the limit"


def isa_where(f: Figure) -> str:
    """The ISA a figure's kernels ran, and for an AVX2 build whether the CPU itself is an AVX2
    one (native) or an AVX-512 one capped at AVX2 (forced); older figures lack `cpu_isas`."""
    isa, cpu = f.get("isa") or "?", f.get("cpu_isas")
    if cpu is None or not isa.startswith("AVX2"):
        return isa
    return f"{isa} ({'forced on an AVX-512 CPU' if 'avx512f' in cpu else 'native'})"


def summary_table(latest: dict[str, Any]) -> str:
    lines = ["| figure | value | spread (min-max) | runs | target | verdict | CPU, kernels |",
             "|---|---:|---:|---:|---|---|---|"]
    for f in latest["figures"]:
        unit = "" if f["unit"] == "x" else f" {f['unit']}"
        value = f"{_num(f['value'])}{'x' if f['unit'] == 'x' else unit}"
        span = "" if not f["spread"] else f"{_num(f['spread'][0])}-{_num(f['spread'][1])}"
        where = f"{f.get('cpu') or 'CPU not recorded'}, {isa_where(f)}"
        lines.append(f"| {f['name']} | {value} | {span} | {f['runs']} | {f['target'] or ''} "
                     f"| {verdict(f)} | {where} |")
    m = latest["machine"]
    missed = [f for f in latest["figures"] if f["meets"] is False]
    lines += ["", f"{len(latest['figures'])} figures, {len(missed)} targets missed. Each "
              "figure's CPU and the ISA its kernels ran are in its last column (a benchmark "
              "keeps its figures until it is run again, so they can come from different "
              f"machines); last written on {m.get('nproc')} CPUs ({m.get('cpu', 'CPU model not recorded')}; kernels built "
              f"for {', '.join(m.get('kernel_isas') or ['no vector ISA recorded'])}), "
              f"{m.get('platform')}, Python {m.get('python')}, "
              f"{latest['date']}, by `make bench` from `benchmarks/results/latest.json`; "
              f"figures marked [{FORCED.upper()} build] come from `make bench ISA={FORCED}` "
              f"(kernels, XLA and torch capped at AVX2+FMA; detail in `benchmarks/results/{FORCED}/`), "
              "on the CPU their last column names: \"native\" where that CPU has no AVX-512; "
              "docs/results-detail.md gives each benchmark's detail."]
    if latest["plots"]:
        lines += ["", " ".join(f"![{Path(p).stem}](../benchmarks/results/plots/{Path(p).name})"
                                for p in latest["plots"])]
    failed = [name for name, run in latest["runs"].items() if run["rc"] != 0]
    if failed:
        lines += ["", f"Failed in this run (no figures): {', '.join(failed)}."]
    return "\n".join(lines)


# the README's few figures, by name (a name absent from a run is left out): ours beside the
# peers a team would try, on the same machine and work (docs/results.md has every figure)
HEADLINE = (
    "tokens/s, burst of 32, 16 adapters: ours / vLLM",
    "TTFT p99, burst of 32, 16 adapters: ours / vLLM",
    "tokens/s, 32 streams closed loop, Zipf over 48 adapters: ours / vLLM",
    "decode, 16 distinct adapters, float32: ours / llama.cpp",
    "decode, base model, float32: ours / llama.cpp",
    "served, 16 distinct adapters / PEFT mixed batch",
    "decode, 16 distinct adapters / base model",
)


def headline_table(latest: dict[str, Any]) -> str:
    """The README's block: the `HEADLINE` figures of `latest`, as summary_table shows them."""
    by_name = {f["name"]: f for f in latest["figures"]}
    chosen = [by_name[n] for n in HEADLINE if n in by_name]
    if not chosen:
        return "No headline figure in the last run: `make bench` writes them (docs/results.md)."
    rows = summary_table({**latest, "figures": chosen, "plots": [], "runs": {}}).split("\n\n")[0]
    missed = sum(f["meets"] is False for f in latest["figures"])
    return (f"{rows}\n\nFrom `make bench` on {latest['machine'].get('nproc')} CPUs "
            f"({latest['machine'].get('cpu', 'CPU model not recorded')}), {latest['date']}. "
            f"Every figure ({len(latest['figures'])}, {missed} targets missed): "
            "[docs/results.md](docs/results.md); each benchmark's detail: "
            "[docs/results-detail.md](docs/results-detail.md).")


def write_tables(latest: dict[str, Any], readme: Path, results_doc: Path) -> None:
    """The table of every figure into `results_doc`, the headline block into `readme`."""
    update_readme("summary", summary_table(latest), readme=results_doc)
    update_readme("headline", headline_table(latest), readme=readme)


# ---- running ----------------------------------------------------------------------------

def run_bench(bench: Bench, quick: bool, env: dict[str, str], log: Path | None = None) -> dict[str, Any]:
    """One benchmark in a process of its own; its output to ours, or to `log` (printed after it,
    whole, where it failed)."""
    cmd = [sys.executable, "-m", bench.module, *(bench.quick if quick else ())]
    print(f"== {bench.name}: {' '.join(cmd[1:])}" + (f" (output in {log})" if log else ""), flush=True)
    if bench.cold_compiles:
        env = {**env, "JAX_ENABLE_COMPILATION_CACHE": "false"}
    t0 = time.perf_counter()
    if log is None:
        rc = subprocess.run(cmd, env=env).returncode
    else:
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("w") as f:
            rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
        if rc != 0:
            print(f"== {bench.name} failed ({rc}):\n{log.read_text()}", flush=True)
    seconds = round(time.perf_counter() - t0, 1)
    if log is not None:
        print(f"== {bench.name}: done in {seconds} s, exit {rc}", flush=True)
    return {"rc": rc, "seconds": seconds, "args": cmd[3:]}


def run_benches(chosen: list[Bench], quick: bool, env: dict[str, str], out: Path,
                jobs: int) -> dict[str, dict[str, Any]]:
    """Each chosen benchmark's run, in BENCHES order; `jobs` > 1 (a smoke run only: side by side
    they would colour each other's timings) runs that many at once, each one's output in
    OUT/logs/NAME.log."""
    if jobs <= 1:
        return {b.name: run_bench(b, quick, env) for b in chosen}
    with ThreadPoolExecutor(jobs) as pool:
        done = pool.map(lambda b: run_bench(b, quick, env, out / "logs" / f"{b.name}.log"), chosen)
        return dict(zip((b.name for b in chosen), done))


def figures_of(out: Path, runs: dict[str, dict[str, Any]]) -> list[Figure]:
    """Every figure of the benchmarks that ran well into `out`, each with the CPU it was taken
    on and the ISA its kernels were built for (from the benchmark's own `machine` record)."""
    figures: list[Figure] = []
    for name, extract in FIGURES.items():
        path = out / f"{name}.json"
        if name not in runs or runs[name]["rc"] != 0 or not path.is_file():
            continue
        data = json.loads(path.read_text())
        machine = data.get("machine") or {}
        tags = {"cpu": machine.get("cpu"), "kernel_isas": machine.get("kernel_isas"),
                "cpu_isas": machine.get("cpu_isas"),
                "isa": isa_label(machine.get("kernel_isas"))}
        figures += [{**f, **tags} for f in extract(data)]
    return figures


def collect(out: Path, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """latest.json's content for `out`; for the repository's results, the forced-AVX2 run's
    figures (`--isa avx2`, kept in RESULTS/avx2/) follow the native run's."""
    figures = figures_of(out, runs)
    forced: dict[str, Any] = {}
    forced_dir = out / FORCED
    if out.resolve() == RESULTS_DIR.resolve() and (forced_dir / "latest.json").is_file():
        forced_runs = json.loads((forced_dir / "latest.json").read_text()).get("runs", {})
        forced = {"runs": forced_runs, "figures": figures_of(forced_dir, forced_runs)}
        figures += [{**f, "name": f"{f['name']} [{FORCED.upper()} build]"} for f in forced["figures"]]
    machine = machine_info()
    return {"machine": machine, "date": machine["date"], "figures": figures, "runs": runs,
            **({"forced_isa_runs": forced["runs"]} if forced else {}), "plots": []}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: tiny settings, results in --out (default a temp dir)")
    ap.add_argument("--only", default="", help="comma-separated benchmark names (default all)")
    ap.add_argument("--skip", default="", help="comma-separated benchmark names not to run (e.g. vllm)")
    ap.add_argument("--out", type=Path, default=None,
                    help="where results, plots and (for --quick) the copies of the README and docs/results*.md go")
    ap.add_argument("--collect-only", action="store_true",
                    help="run nothing: rebuild latest.json, plots and table from the results")
    ap.add_argument("--jobs", type=int, default=1,
                    help="with --quick: run this many benchmarks at once, each one's output in "
                         "OUT/logs/NAME.log (a smoke run times nothing; `make test` uses 2)")
    ap.add_argument("--isa", choices=("native", "avx2"), default=None,
                    help="build the native kernels for this ISA in every bench process "
                         "(sets LORAPLANE_KERNEL_ISA; avx2 measures an AVX2+FMA CPU on an AVX-512 one)")
    a = ap.parse_args(argv)
    if a.jobs < 1:
        ap.error(f"--jobs {a.jobs}: runs at least 1 benchmark at a time")
    if a.jobs > 1 and not a.quick:
        ap.error(f"--jobs {a.jobs} needs --quick: a full run times its benchmarks one at a time, "
                 "since side by side they colour each other's timings")
    forced = a.isa == FORCED
    # a forced-ISA run redoes only what the ISA changes, unless --only says otherwise
    chosen = [b for b in BENCHES if (b.name in a.only.split(",") if a.only else b.isa_bound or not forced)
              and b.name not in a.skip.split(",")]
    out = a.out or (Path(tempfile.mkdtemp(prefix="loraplane-bench-")) if a.quick
                    else RESULTS_DIR / FORCED if forced else RESULTS_DIR)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if a.isa:
        env["LORAPLANE_KERNEL_ISA"] = os.environ["LORAPLANE_KERNEL_ISA"] = a.isa  # also for built_isas() here
    if forced:  # XLA's own ops and PEFT's torch run AVX2 code too: an AVX2 machine, all through
        env = forced_isa_env(env)
    readme, results_doc = README, RESULTS_DOC
    if out.resolve() != RESULTS_DIR.resolve():
        env[OUT_ENV] = str(out)
        readme, results_doc = out / README.name, out / RESULTS_DOC.name
        for source in (README, RESULTS_DOC, DETAIL_DOC):  # the benchmarks write their sections there
            if not (out / source.name).exists():
                shutil.copyfile(source, out / source.name)
    runs: dict[str, dict[str, Any]] = {}
    previous = out / "latest.json"
    if a.collect_only or a.only or a.skip:  # keep what this run does not redo
        if previous.is_file():
            runs = json.loads(previous.read_text()).get("runs", {})
        for b in BENCHES:
            if b.isa_bound or not forced:
                runs.setdefault(b.name, {"rc": 0, "seconds": None, "args": []})
    if not a.collect_only:
        runs.update(run_benches(chosen, a.quick, env, out, a.jobs))
    latest = collect(out, runs)
    latest["quick"] = a.quick
    latest["plots"] = [str(p.relative_to(out)) for p in plots.draw(out, out / "plots")]
    previous.write_text(json.dumps(latest, indent=2) + "\n")
    write_tables(latest, readme, results_doc)
    if out.resolve() == (RESULTS_DIR / FORCED).resolve():  # the repository's table shows both runs
        main = json.loads((RESULTS_DIR / "latest.json").read_text()) \
            if (RESULTS_DIR / "latest.json").is_file() else {}
        both = collect(RESULTS_DIR, main.get("runs", {}))
        if "machine" in main:  # the table's footer names the native run's machine and ISA
            both["machine"], both["date"] = main["machine"], main["date"]
        both["quick"], both["plots"] = False, [str(p.relative_to(RESULTS_DIR)) for p in
                                               sorted((RESULTS_DIR / "plots").glob("*.png"))]
        (RESULTS_DIR / "latest.json").write_text(json.dumps(both, indent=2) + "\n")
        write_tables(both, README, RESULTS_DOC)
    for f in latest["figures"]:
        mark = verdict(f) or "-"
        print(f"{mark:>5.4}  {f['name']}: {_num(f['value'])} {f['unit']}"
              + (f" (target {f['target']})" if f["target"] else ""))
    print(f"wrote {previous}, {len(latest['plots'])} plots, the table in {results_doc} and the headline in {readme}")
    failed = [n for n, r in runs.items() if r["rc"] != 0]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
