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
  them (`HEADLINE` in harness/records.py: beside vLLM, llama.cpp and PEFT) between the README's
  `bench:headline` ones (benchmarks/harness/tables.py finds each file by its markers).

Each bench is a module with its workload, a `main` that writes its results, and `figures(results)`,
the figures it declares; what they share is in benchmarks/harness/.

`--quick` is a smoke run of the whole pipeline (tiny settings, one repeat); it
writes into `--out` (default: a fresh temp dir) and copies of README.md and docs/results*.md
there (every file holding a table's or a bench's markers), never into the repository.
`make test` runs it once so the suite cannot rot.

    .venv/bin/python -m benchmarks [--quick [--jobs 2]] [--only events,replay] [--skip vllm] [--out DIR]
        [--collect-only] [--isa avx2]
"""
from __future__ import annotations

import argparse
import importlib
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
from typing import IO, Any

from benchmarks import plots
from benchmarks.harness import OUT_ENV, RESULTS_DIR, Figure, forced_isa_env, isa_label, machine_info, update_section
from benchmarks.harness.machine import FORCED
from benchmarks.harness.records import headline_table, num, summary_table, verdict
from benchmarks.harness.tables import tables_file
from statesvc.tools.processes import PORT_SHARE_ENV


@dataclass(frozen=True)
class Bench:
    name: str
    module: str
    quick: tuple[str, ...]  # arguments for a smoke run
    isa_bound: bool = False  # its figures depend on the ISA the kernels are built for
    # a figure times what a cold start compiles: never run with a JAX persistent compilation
    # cache (the one `make test` gives the processes it starts, tests/conftest.py)
    cold_compiles: bool = False
    smoke_s: int = 30  # about how long its smoke run takes beside another (docs/testing.md): the queue's order

    def figures(self, results: dict[str, Any]) -> list[Figure]:
        """The figures the bench declares (its module's `figures`) from its results."""
        return list(importlib.import_module(self.module).figures(results))


BENCHES = (
    Bench("events", "benchmarks.bench_events", ("--quick",), smoke_s=12),
    Bench("pg", "benchmarks.bench_pg", ("--quick",), smoke_s=85),  # no results where PostgreSQL is missing
    Bench("replica", "benchmarks.bench_replica", ("--quick",), smoke_s=40),
    Bench("replay", "benchmarks.bench_replay", ("--quick",), smoke_s=17),
    Bench("decode", "benchmarks.bench_decode", ("--quick",), isa_bound=True, smoke_s=100),
    Bench("dtype", "benchmarks.bench_dtype", ("--quick",), isa_bound=True, smoke_s=80),
    # decode per model family: 16 adapters / base, ours / PEFT, over Llama's (issue 38)
    Bench("families", "benchmarks.bench_families", ("--quick",), isa_bound=True, smoke_s=55),
    Bench("residency", "benchmarks.bench_residency", ("--quick",), cold_compiles=True, smoke_s=85),
    Bench("gateway", "benchmarks.bench_gateway", ("--quick",), smoke_s=50),
    # a good client beside slow connections and a flood of oversized prompts (issue 50)
    Bench("hostile", "benchmarks.bench_gateway_hostile", ("--quick",), smoke_s=30),
    Bench("tp", "benchmarks.bench_tp", ("--quick",), smoke_s=50),  # forced CPU devices: overhead, not speed-up
    # llama.cpp beside ours; a forced AVX2 run pairs our AVX2 kernels with an AVX2 build of the peer
    Bench("peer", "benchmarks.bench_peer_llamacpp", ("--quick",), isa_bound=True, smoke_s=3),
    # the prefix cache and chunked prefill, each beside itself switched off (issue 41)
    Bench("prefix", "benchmarks.bench_prefix", ("--quick",), isa_bound=True, smoke_s=20),
    # a real model's geometry (Qwen2.5-0.5B, bf16) against this machine's floors; startup (issue 48)
    Bench("shapes", "benchmarks.bench_shapes", ("--quick",), isa_bound=True, smoke_s=65),
    # structured outputs (issue 49): 16 json_schema rows in a batch of 32, grammar compiles
    Bench("structured", "benchmarks.bench_structured", ("--quick",), isa_bound=True, smoke_s=13),
    # vLLM's CPU server beside our fleet, both through the OpenAI API (issue 39); `--skip vllm`
    Bench("vllm", "benchmarks.bench_peer_vllm", ("--quick",), smoke_s=3),
)


def write_tables(latest: dict[str, Any], readme: Path, results_doc: Path) -> None:
    """The table of every figure into `results_doc`, the headline block into `readme`."""
    update_section(results_doc, "summary", summary_table(latest))
    update_section(readme, "headline", headline_table(latest))


def copy_tables_files(out: Path) -> None:
    """Copies, in `out`, of every file holding the suite's tables or a bench's section (README.md,
    docs/results.md, docs/results-detail.md), which the benches and the suite then write."""
    for home in sorted({tables_file(n) for n in ("summary", "headline", *(b.name for b in BENCHES))}):
        if not (out / home.name).exists():
            shutil.copyfile(home, out / home.name)


def run_bench(bench: Bench, quick: bool, env: dict[str, str], log: Path | None = None) -> dict[str, Any]:
    """One benchmark in a process of its own; its output to ours, or to `log` (printed after it,
    whole, where it failed)."""
    cmd = [sys.executable, "-m", bench.module, *(bench.quick if quick else ())]
    print(f"== {bench.name}: {' '.join(cmd[1:])}" + (f" (output in {log})" if log else ""), flush=True)
    if bench.cold_compiles:
        env = {**env, "JAX_ENABLE_COMPILATION_CACHE": "false"}
    # ports of its own: with --jobs, benchmarks side by side never pick the same one
    env = {**env, PORT_SHARE_ENV: f"{BENCHES.index(bench)}/{len(BENCHES)}"}
    t0 = time.perf_counter()
    if log is None:
        rc, cpu = _run(cmd, env, None)
    else:
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("w") as f:
            rc, cpu = _run(cmd, env, f)
        if rc != 0:
            print(f"== {bench.name} failed ({rc}):\n{log.read_text()}", flush=True)
    seconds = round(time.perf_counter() - t0, 1)
    if log is not None:
        print(f"== {bench.name}: done in {seconds} s ({cpu} s CPU), exit {rc}", flush=True)
    return {"rc": rc, "seconds": seconds, "cpu_s": cpu, "args": cmd[3:]}


def _run(cmd: list[str], env: dict[str, str], log: IO[str] | None) -> tuple[int, float]:
    """`cmd`'s exit status and the CPU seconds (user + system) it and the processes it waited
    for used: what a smoke run costs, whatever else shares the machine."""
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT if log else None)
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    except BaseException:  # interrupted: stop it
        proc.kill()
        proc.wait()
        raise
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, round(usage.ru_utime + usage.ru_stime, 1)


def run_benches(chosen: list[Bench], quick: bool, env: dict[str, str], out: Path,
                jobs: int) -> dict[str, dict[str, Any]]:
    """Each chosen benchmark's run, in BENCHES order; `jobs` > 1 (a smoke run only: side by side
    they would colour each other's timings) runs that many at once, the longest smoke runs
    first, each one's output in OUT/logs/NAME.log."""
    if jobs <= 1:
        return {b.name: run_bench(b, quick, env) for b in chosen}
    longest_first = sorted(chosen, key=lambda b: -b.smoke_s)  # the queues end closer together
    with ThreadPoolExecutor(jobs) as pool:
        done = dict(zip((b.name for b in longest_first),
                        pool.map(lambda b: run_bench(b, quick, env, out / "logs" / f"{b.name}.log"),
                                 longest_first)))
    return {b.name: done[b.name] for b in chosen}


def figures_of(out: Path, runs: dict[str, dict[str, Any]]) -> list[Figure]:
    """Every figure of the benchmarks that ran well into `out`, each with the CPU it was taken
    on and the ISA its kernels were built for (from the benchmark's own `machine` record)."""
    figures: list[Figure] = []
    for bench in BENCHES:
        path = out / f"{bench.name}.json"
        if bench.name not in runs or runs[bench.name]["rc"] != 0 or not path.is_file():
            continue
        data = json.loads(path.read_text())
        machine = data.get("machine") or {}
        tags = {"cpu": machine.get("cpu"), "kernel_isas": machine.get("kernel_isas"),
                "cpu_isas": machine.get("cpu_isas"),
                "isa": isa_label(machine.get("kernel_isas"))}
        figures += [{**f, **tags} for f in bench.figures(data)]
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
    # the headline's file (README.md) and the table's (docs/results.md), or their copies in `out`
    home_readme, home_results = tables_file("headline"), tables_file("summary")
    readme, results_doc = home_readme, home_results
    if out.resolve() != RESULTS_DIR.resolve():
        env[OUT_ENV] = str(out)
        copy_tables_files(out)  # the benchmarks write their sections there
        readme, results_doc = out / home_readme.name, out / home_results.name
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
        write_tables(both, home_readme, home_results)
    for f in latest["figures"]:
        mark = verdict(f) or "-"
        print(f"{mark:>5.4}  {f['name']}: {num(f['value'])} {f['unit']}"
              + (f" (target {f['target']})" if f["target"] else ""))
    print(f"wrote {previous}, {len(latest['plots'])} plots, the table in {results_doc} and the headline in {readme}")
    failed = [n for n, r in runs.items() if r["rc"] != 0]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
