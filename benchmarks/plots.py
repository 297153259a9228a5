"""PNG plots of the benchmarks' results files (matplotlib, no display needed).

`draw(results, into)` draws what the results dir holds and returns the files
written; a benchmark whose results file is missing simply has no plot.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import matplotlib

from benchmarks.harness import decode_rates, median

matplotlib.use("Agg")  # files only: no display on CI or servers
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402


def _errs(medians: list[float], runs: list[list[float]]) -> list[list[float]]:
    """Error bars from each median down to the slowest and up to the fastest run."""
    return [[m - min(r) for m, r in zip(medians, runs)], [max(r) - m for m, r in zip(medians, runs)]]


def events(r: dict[str, Any], ax: Axes) -> None:
    runs = {k: [x["events_per_s"] for x in r["runs"][k]] for k in ("raw", "single", "concurrent")}
    labels = ["raw sqlite3", "statesvc, 1 client", f"statesvc, {r['settings']['clients']} clients"]
    meds = [median(v) for v in runs.values()]
    ax.bar(labels, meds, yerr=_errs(meds, list(runs.values())), capsize=4,
           color=["#999999", "#4c72b0", "#4c72b0"])
    ax.axhline(1000, color="#c44e52", linestyle=":", label="target 1,000/s")
    ax.axhline(meds[0] * 0.5, color="#dd8452", linestyle="--", label="target 0.5x raw")
    ax.set_ylabel("durable events/s")
    ax.set_title("event append")
    ax.legend()


def propagation(r: dict[str, Any], ax: Axes) -> None:
    rows = r["propagation"]
    n = [p["replicas"] for p in rows]
    ax.plot(n, [p["from_ack_ms_p50"] for p in rows], "o-", label="ack to applied, p50")
    ax.plot(n, [p["from_ack_ms_p99"] for p in rows], "s-", label="ack to applied, p99")
    floor = r["read_sha256"]["read_sha256_ms_p50"]
    ax.axhline(floor, color="#999999", linestyle="--", label="read + sha256 of the file")
    ax.axhline(2 * floor, color="#c44e52", linestyle=":", label="target: p99 <= 2x that")
    ax.set_xticks(n)
    ax.set_xlabel("replicas")
    ax.set_ylabel("ms")
    ax.set_title("propagation of a load")
    ax.legend()


def replay(r: dict[str, Any], ax: Axes) -> None:
    sizes = r["sizes"]
    n = [row["events"] for row in sizes]
    for mode, label, style in (("snapshot", "replay, with snapshots", "o-"),
                               ("from_zero", "replay, without snapshots", "s-"),
                               ("direct", "direct load of the live set", "^--"),
                               ("files", "floor: files to pool, in-process", "v:")):
        meds = [row[f"{mode}_s"] * 1e3 for row in sizes]
        runs = [[s * 1e3 for s in row["seconds"][mode]] for row in sizes]
        ax.errorbar(n, meds, yerr=_errs(meds, runs), fmt=style, capsize=3, label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("events in the log")
    ax.set_ylabel("cold rebuild, ms")
    ax.set_title(f"replay with {r['settings']['live']} live adapters")
    ax.legend()


def decode(r: dict[str, Any], ax: Axes) -> None:
    results = r["results"]
    steps, batch = r["settings"]["steps"], r["settings"]["batch"]
    ks = sorted(results, key=int)
    for impl, label, style in (("decode", "loraplane (native kernels)", "o-"),
                               ("engine", "loraplane Engine.step", "o--"),
                               ("loop", "loraplane, XLA only (no native kernels)", "d:"),
                               ("gather", "per-token gather (BGMV-style)", "s-"),
                               ("peft", "PEFT mixed batch", "^-")):
        have = [k for k in ks if impl in results[k]]
        if not have:
            continue
        runs = [decode_rates(results[k][impl], batch * steps) for k in have]
        meds = [median(v) for v in runs]
        ax.errorbar([int(k) for k in have], meds, yerr=_errs(meds, runs), fmt=style, capsize=3,
                    label=label)
    ax.set_xscale("symlog", linthresh=1)
    ax.set_xticks([int(k) for k in ks], [str(k) for k in ks])
    ax.set_xlabel("distinct adapters in the batch")
    ax.set_ylabel(f"decode tokens/s, batch {batch}")
    ax.set_title("multi-LoRA decode")
    ax.set_ylim(bottom=0)
    ax.legend()


def rss(r: dict[str, Any], ax: Axes) -> None:
    trace = r["rss"]["rss_mb_trace"]
    ax.plot([0] + [t["cycles"] for t in trace],
            [r["rss"]["rss_mb_after_warmup"]] + [t["rss_mb"] for t in trace], "o-")
    ax.axhline(r["rss"]["rss_mb_after_warmup"] * 1.05, color="#c44e52", linestyle=":",
               label="target: at most +5%")
    ax.set_xlabel("load/unload cycles")
    ax.set_ylabel("RSS of computed serve, MB")
    ax.set_title("replica memory over churn")
    ax.set_ylim(bottom=0)
    ax.legend()


PLOTS: tuple[tuple[str, str, Callable[[dict[str, Any], Axes], None]], ...] = (
    ("events", "events", events), ("replica", "propagation", propagation),
    ("replay", "replay", replay), ("decode", "decode", decode), ("replica", "rss", rss))


def draw(results: Path, into: Path) -> list[Path]:
    into.mkdir(parents=True, exist_ok=True)
    written = []
    for bench, name, plot in PLOTS:
        path = results / f"{bench}.json"
        if not path.is_file():
            continue
        fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
        try:
            plot(json.loads(path.read_text()), ax)
            fig.tight_layout()
            fig.savefig(into / f"{name}.png")
            written.append(into / f"{name}.png")
        finally:
            plt.close(fig)
    return written
