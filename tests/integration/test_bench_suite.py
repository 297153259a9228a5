"""`make bench` end to end in its quick mode, so the suite cannot rot; and its verdict logic."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.harness import RESULTS_DIR, figure, tables_file
from benchmarks.harness.records import HEADLINE, shortfall, verdict
from benchmarks.suite import BENCHES
from testkit.pg import PgServer

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.glob("*.json"))}


@pytest.mark.slow
@pytest.mark.timeout(1560)
def test_quick_suite_writes_figures_plots_and_the_results_tables(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    committed = _snapshot(RESULTS_DIR)
    # two benchmarks at a time: most of a smoke run is compiling and waiting on processes. Alone
    # on a 2-CPU machine at load ~3.5 it took 6 minutes (636 s CPU, each benchmark's in
    # latest.json's `runs`); beside the other xdist worker in CI it took over 14 (docs/testing.md),
    # so the wait is 25: a hang still fails it
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks", "--quick", "--jobs", "2", "--out", str(out)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its own group: every child stops with it
    try:
        log, _ = proc.communicate(timeout=1500)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, log[-4000:]
    # every benchmark's smoke run ran, each one's output in a log of its own
    assert {p.stem for p in (out / "logs").glob("*.log")} == {b.name for b in BENCHES}

    latest = json.loads((out / "latest.json").read_text())
    assert {"machine", "date", "figures"} <= set(latest)
    # bench_pg has no results, and says why, where the PostgreSQL binaries are missing; the
    # llama.cpp peer has figures only where its venv was built (a quick run never builds it)
    peer = json.loads((out / "peer.json").read_text())
    assert peer["peer"] in ("built", "not built"), peer
    # likewise vLLM's, where its venv was installed (a quick run never installs it)
    vllm = json.loads((out / "vllm.json").read_text())
    assert vllm["peer"] in ("installed", "not installed"), vllm
    absent = ({"pg"} if PgServer.missing() else set()) | (set() if peer["peer"] == "built" else {"peer"}) \
        | (set() if vllm["peer"] == "installed" else {"vllm"})
    assert {f["bench"] for f in latest["figures"]} == {b.name for b in BENCHES} - absent
    for f in latest["figures"]:
        assert {"name", "value", "unit", "target", "meets"} <= set(f), f
        assert isinstance(f["value"], float) and f["value"] >= 0, f
        # a figure with a target carries a verdict; one without has none
        assert (f["meets"] is None) == (f["target"] is None), f
        if f["spread"] is not None:
            low, high = f["spread"]
            assert low <= high, f
    named = {f["name"] for f in latest["figures"]}
    assert any("/ raw sqlite3" in n for n in named)
    assert absent or any("/ raw psycopg" in n for n in named)
    assert any("per-token gather" in n for n in named)
    assert any("PEFT" in n for n in named)
    assert any(n.startswith("served") and "Engine.step" in n for n in named)  # the served path ran

    assert latest["plots"], "no plots were drawn"
    for plot in latest["plots"]:
        assert (out / plot).read_bytes().startswith(PNG_MAGIC), plot

    # every figure in the results page's copy, the headline's in the README's, each benchmark's
    # section in the detail page's (docs/results.md, README.md, docs/results-detail.md: the
    # files tables_file finds their markers in, copied into --out by the suite)
    results = (out / tables_file("summary").name).read_text()
    table = results.split("<!-- bench:summary:start -->")[1].split("<!-- bench:summary:end -->")[0]
    for f in latest["figures"]:
        assert f"| {f['name']} |" in table, f["name"]
    readme = (out / tables_file("headline").name).read_text()
    headline = readme.split("<!-- bench:headline:start -->")[1].split("<!-- bench:headline:end -->")[0]
    for name in HEADLINE:
        assert (f"| {name} |" in headline) == (name in {f["name"] for f in latest["figures"]}), name
    def events_section(page: Path) -> str:
        return page.read_text().split("<!-- bench:events:start -->")[1].split("<!-- bench:events:end -->")[0]

    detail = tables_file("events")
    assert events_section(out / detail.name) != events_section(detail)  # this run's
    # a smoke run never writes over the repository's figures
    assert _snapshot(RESULTS_DIR) == committed


def test_verdicts_say_how_far_a_missed_target_is() -> None:
    low = figure("x", "ratio", 0.3, "x", target=">= 0.5x", meets=False)
    high = figure("x", "p99", 12.0, "x", target="<= 2x", meets=False)
    rate = figure("x", "rate", 800.0, "events/s", target=">= 1,000", meets=False)
    compiles = figure("x", "compiles", 3.0, "compiles", target="0", meets=False)
    assert shortfall(low) == "60% of the target"
    assert shortfall(high) == "6.0x the limit"
    assert shortfall(rate) == "80% of the target"
    assert "instead of 0" in shortfall(compiles)
    # a limit every run must meet, whose median is under it
    noisy = figure("x", "added p50", -82.5, "ms", target="< 2", meets=False,
                   spread=[-2932.4, 1582.9])
    assert shortfall(noisy) == "the median is under it, runs up to 1,583"
    assert verdict(figure("x", "ok", 1.0, "x", target=">= 0.5x", meets=True)) == "PASS"
    assert verdict(figure("x", "info", 1.0, "x")) == ""
