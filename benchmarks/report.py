"""Where benchmark results go: a JSON file under benchmarks/results/ and a section of the results page.

A section is the text between `<!-- bench:NAME:start -->` and `<!-- bench:NAME:end -->`, in
docs/results-detail.md (each benchmark's own), docs/results.md (the table of every figure) or
README.md (the headline); `update_readme("NAME", markdown)` replaces it wherever its markers
are and leaves the markers and everything else as they were.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path
from collections.abc import Iterable, Sequence
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
RESULTS_DOC = REPO / "docs" / "results.md"  # the table of every figure (benchmarks/suite.py)
DETAIL_DOC = REPO / "docs" / "results-detail.md"  # each benchmark's own section (`publish`)
RESULTS_DIR = REPO / "benchmarks" / "results"
# set by `python -m benchmarks --out DIR`: results and the copies of README.md and the two results
# pages (as DIR/README.md, DIR/results.md, DIR/results-detail.md) go to DIR instead
OUT_ENV = "LORAPLANE_BENCH_OUT"


def results_dir() -> Path:
    out = os.environ.get(OUT_ENV)
    return Path(out) if out else RESULTS_DIR


def readme_path() -> Path:
    out = os.environ.get(OUT_ENV)
    return Path(out) / "README.md" if out else README


def results_doc_paths() -> list[Path]:
    """docs/results-detail.md and docs/results.md, or their copies in the suite's --out dir."""
    out = os.environ.get(OUT_ENV)
    return [Path(out) / d.name for d in (DETAIL_DOC, RESULTS_DOC)] if out else [DETAIL_DOC, RESULTS_DOC]


def may_write(quick: bool) -> bool:
    """A quick (smoke) run writes only where the suite pointed it, never over the repo's figures."""
    return not quick or OUT_ENV in os.environ


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform module says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_isas() -> list[str]:
    """The vector ISAs the CPU itself offers (from /proc/cpuinfo's flags), whatever a run forced:
    beside `kernel_isas` it tells a native AVX2 machine from an AVX-512 one capped at AVX2."""
    wanted = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512bf16", "asimd")
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                have = set(line.split(":", 1)[1].split())
                return [f for f in wanted if f in have]
    except OSError:
        pass
    return []


# What `--isa avx2` sets beside our kernels' forced build, so that everything else in the
# run (XLA's own ops, and torch under PEFT: ATen's kernels, oneDNN, MKL) also runs AVX2 code
# and the ratios are those of an AVX2 machine, not of our AVX2 code against AVX-512 peers.
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
            "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
AVX2_XLA_FLAG = "--xla_cpu_max_isa=AVX2"


def forced_isa_env(env: dict[str, str]) -> dict[str, str]:
    """`env` with the peers' and XLA's vector ISA capped at AVX2 (see AVX2_ENV)."""
    flags = env.get("XLA_FLAGS", "")
    if AVX2_XLA_FLAG not in flags:
        flags = f"{flags} {AVX2_XLA_FLAG}".strip()
    return {**env, **AVX2_ENV, "XLA_FLAGS": flags}


def machine_info() -> dict[str, Any]:
    """What a reader needs to compare runs: the CPU and the vector instruction sets the native
    kernels are built for here, Python, OS and when it ran."""
    from computed.backend.kernels import built_isas

    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "cpu": cpu_model(), "kernel_isas": built_isas(), "cpu_isas": cpu_isas(),
            "nproc": os.cpu_count(),
            "python": platform.python_version(),
            "implementation": sys.implementation.name,
            "platform": platform.platform(),
            "machine": platform.machine(),
            # set where a run capped everyone's ISA (`make bench ISA=avx2`)
            "isa_caps": {k: os.environ[k] for k in (*AVX2_ENV, "XLA_FLAGS") if k in os.environ}}


def median(values: Iterable[float]) -> float:
    return float(statistics.median(values))


def percentile(values: Sequence[float], q: float) -> float:
    """The `q`th percentile of `values` (numpy's, interpolated between the nearest two)."""
    import numpy as np

    return float(np.percentile(np.asarray(values), q))


def spread(values: list[float]) -> list[float]:
    """[min, max] of the runs behind a median: how far apart the repeats landed."""
    return [float(min(values)), float(max(values))]


def write_results(name: str, data: dict[str, Any]) -> Path:
    """Write `data` as NAME.json in the results dir; returns the path."""
    out = results_dir()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    return path


def update_readme(marker: str, markdown: str, *, readme: Path | None = None) -> bool:
    """Replace the text between the `bench:MARKER` markers, in `readme`, else in the first of
    docs/results-detail.md, docs/results.md and README.md that has them; False when none has."""
    start, end = f"<!-- bench:{marker}:start -->", f"<!-- bench:{marker}:end -->"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
    for doc in [readme] if readme else [*results_doc_paths(), readme_path()]:
        if not doc.is_file():
            continue
        text = doc.read_text()
        if pattern.search(text):
            section = f"{start}\n{markdown.strip()}\n{end}"
            doc.write_text(pattern.sub(lambda _: section, text, count=1))
            return True
    return False


def decode_rates(cell: dict[str, Any], tokens: int) -> list[float]:
    """tokens/s of the rounds a decode figure is taken from (`used_rounds`; None: all)."""
    used = cell.get("used_rounds")
    return [tokens / cell["seconds"][i] for i in (range(len(cell["seconds"])) if used is None else used)]


def show_and_publish(name: str, result: dict[str, Any], table: Any, markdown: str, *,
                     quick: bool, no_write: bool, console: Any) -> None:
    """Print a benchmark's table and verdicts, then `publish` it."""
    console.print(table)
    print_targets(result, console.print)
    publish(name, result, markdown, quick=quick, no_write=no_write, say=console.print)


def _measured(t: dict[str, Any]) -> str:
    return f"{t['measured']:,}" if isinstance(t["measured"], (int, float)) else str(t["measured"])


def print_targets(result: dict[str, Any], say: Callable[[str], None]) -> None:
    """One PASS/MISS line (rich markup) per entry of `result["targets"]`."""
    for t in result["targets"]:
        verdict = "[green]PASS[/green]" if t["met"] else "[red]MISS[/red]"
        say(f"{verdict} {t['name']}: {_measured(t)} (target {t['target']})")


def target_lines(result: dict[str, Any]) -> list[str]:
    """The README's verdicts, one markdown line per entry of `result["targets"]`."""
    return [f"- {'PASS' if t['met'] else 'MISS'}: {t['name']} {_measured(t)} (target {t['target']})"
            for t in result["targets"]]


def publish(name: str, result: dict[str, Any], markdown: str, *, quick: bool, no_write: bool,
            say: Callable[[str], None]) -> None:
    """Write NAME.json and the bench:NAME section of docs/results-detail.md, unless told not to or a quick
    run has nowhere but the repository to write (`may_write`)."""
    if no_write or not may_write(quick):
        return
    say(f"results written to {write_results(name, result)}")
    if update_readme(name, markdown):
        say(f"section bench:{name} updated")
    else:
        say(f"[dim]no results page has bench:{name} markers; left alone[/dim]")


def output_flags(ap: argparse.ArgumentParser, name: str, quick_help: str) -> None:
    """A benchmark's --quick (a smoke run) and --no-write flags."""
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--no-write", action="store_true",
                    help=f"print only: leave benchmarks/results/{name}.json and README.md alone")


def peer_output_flags(ap: argparse.ArgumentParser, name: str, quick_help: str) -> None:
    """A side-by-side peer's `output_flags` and its --out FILE."""
    output_flags(ap, name, quick_help)
    ap.add_argument("--out", type=Path, help=f"write the JSON to this file instead of benchmarks/results/{name}.json "
                    "(and leave the README alone)")


def publish_peer(name: str, result: dict[str, Any], markdown: str, args: argparse.Namespace) -> int:
    """Print a peer benchmark's README section, then write it to --out or `publish` it."""
    print(markdown)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"results written to {args.out}")
    publish(name, result, markdown, quick=args.quick, no_write=args.no_write or bool(args.out), say=print)
    return 0


def run_and_publish(name: str, args: argparse.Namespace,
                    run: Callable[[argparse.Namespace], dict[str, Any]],
                    render: Callable[[dict[str, Any]], str]) -> int:
    """Run a benchmark on its parsed `args` (with `output_flags`), print its README section
    and `publish` it."""
    result = run(args)
    markdown = render(result)
    print(markdown)
    publish(name, result, markdown, quick=args.quick, no_write=args.no_write, say=print)
    return 0
