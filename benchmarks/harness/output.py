"""Where a bench's results go, the flags every bench takes, and publishing its results.

A bench writes `RESULTS/NAME.json` and its `bench:NAME` section of the file holding its markers
(`tables_file`: docs/results-detail.md). A quick (smoke) run writes only where
`python -m benchmarks --quick` points it (`OUT_ENV`): there the results and the suite's copies
of the tables files go, never over the repository's figures.
"""
from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.harness.machine import REPO
from benchmarks.harness.tables import tables_file, update_section

RESULTS_DIR = REPO / "benchmarks" / "results"
# set by `python -m benchmarks --out DIR`: results and the copies of the tables files (as
# DIR/README.md, DIR/results.md, DIR/results-detail.md) go to DIR instead
OUT_ENV = "LORAPLANE_BENCH_OUT"


def results_dir() -> Path:
    out = os.environ.get(OUT_ENV)
    return Path(out) if out else RESULTS_DIR


def section_file(name: str) -> Path:
    """The file a bench's `bench:NAME` section is written into (its copy, under OUT_ENV)."""
    home = tables_file(name)
    out = os.environ.get(OUT_ENV)
    return Path(out) / home.name if out else home


def may_write(quick: bool) -> bool:
    """A quick (smoke) run writes only where the suite pointed it, never over the repo's figures."""
    return not quick or OUT_ENV in os.environ


def write_results(name: str, data: dict[str, Any]) -> Path:
    """Write `data` as NAME.json in the results dir; returns the path."""
    out = results_dir()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    return path


def publish(name: str, result: dict[str, Any], markdown: str, *, quick: bool, no_write: bool,
            say: Callable[[str], None] = print) -> None:
    """Write NAME.json and the bench:NAME section, unless told not to or a quick run has
    nowhere but the repository to write (`may_write`)."""
    if no_write or not may_write(quick):
        return
    say(f"results written to {write_results(name, result)}")
    path = section_file(name)
    if update_section(path, name, markdown):
        say(f"{path.name} section bench:{name} updated")
    else:
        say(f"{path.name} has no bench:{name} markers; left alone")


def output_flags(ap: argparse.ArgumentParser, name: str, quick_help: str) -> None:
    """A benchmark's --quick (a smoke run) and --no-write flags."""
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--no-write", action="store_true",
                    help=f"print only: leave benchmarks/results/{name}.json and the tables alone")


def peer_output_flags(ap: argparse.ArgumentParser, name: str, quick_help: str) -> None:
    """A side-by-side peer's `output_flags` and its --out FILE."""
    output_flags(ap, name, quick_help)
    ap.add_argument("--out", type=Path, help=f"write the JSON to this file instead of benchmarks/results/{name}.json "
                    "(and leave the tables alone)")


def publish_peer(name: str, result: dict[str, Any], markdown: str, args: argparse.Namespace) -> int:
    """Print a peer benchmark's section, then write it to --out or `publish` it."""
    print(markdown)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"results written to {args.out}")
    publish(name, result, markdown, quick=args.quick, no_write=args.no_write or bool(args.out))
    return 0


def run_and_publish(name: str, args: argparse.Namespace,
                    run: Callable[[argparse.Namespace], dict[str, Any]],
                    render: Callable[[dict[str, Any]], str]) -> int:
    """Run a benchmark on its parsed `args` (with `output_flags`), print its section and
    `publish` it."""
    result = run(args)
    markdown = render(result)
    print(markdown)
    publish(name, result, markdown, quick=args.quick, no_write=args.no_write)
    return 0
