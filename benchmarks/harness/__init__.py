"""What every benchmark shares, so that a bench module holds only its workload and its figures.

* `machine`: the CPU, its ISAs and the kernels' build, for every results file;
* `stats`: medians, percentiles, spreads, per-round timings and the CPU share others used;
* `rounds`: the alternated order of the sides of a comparison, and the wait for them to settle;
* `fleet`: statesvc, replicas and a gateway as subprocesses, started in order, stopped by pid;
* `records`: figure and target records, their verdicts and the summary table;
* `tables`: the markdown tables and the `bench:NAME` marker sections they are written into;
* `output`: where results go, the flags every bench takes, and publishing them.

The names a bench uses are re-exported here: `from benchmarks.harness import median, Fleet`.
"""
from __future__ import annotations

from benchmarks.harness.fleet import Fleet
from benchmarks.harness.machine import REPO, cpu_model, forced_isa_env, isa_label, machine_info
from benchmarks.harness.output import (OUT_ENV, RESULTS_DIR, output_flags,
                                       peer_output_flags, publish, publish_peer, results_dir,
                                       run_and_publish)
from benchmarks.harness.records import Figure, figure, target_lines
from benchmarks.harness.rounds import alternate, settle
from benchmarks.harness.stats import (Timing, busy_seconds, clean_rounds, decode_rates, median,
                                      paired, percentile, spread, timed)
from benchmarks.harness.tables import markdown_table, tables_file, update_section

__all__ = ["OUT_ENV", "REPO", "RESULTS_DIR", "Figure", "Fleet", "Timing", "alternate",
           "busy_seconds", "clean_rounds", "cpu_model", "decode_rates", "figure",
           "forced_isa_env", "isa_label", "machine_info", "markdown_table", "median",
           "output_flags", "paired", "peer_output_flags", "percentile", "publish",
           "publish_peer", "results_dir", "run_and_publish", "settle", "spread", "tables_file",
           "target_lines", "timed", "update_section"]
