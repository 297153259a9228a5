"""The figures each bench declares (its module's `figures`) rebuild the committed latest.json.

benchmarks/results/latest.json is what `make bench` collected from the benches' own results
files (NAME.json, and avx2/NAME.json for the forced-AVX2 run); run again over those files, the
benches' `figures` functions must give the same figures, record for record. A refactor of a
bench that renames, drops or recomputes a figure fails here before anyone reruns the suite.
"""
from __future__ import annotations

import json
from typing import Any

from benchmarks.harness import RESULTS_DIR
from benchmarks.harness.machine import FORCED
from benchmarks.suite import BENCHES

KEYS = ("name", "value", "unit", "target", "meets", "spread", "runs", "bench")


def declared() -> list[dict[str, Any]]:
    """Every bench's figures from the committed results, the forced-AVX2 run's marked as the
    suite marks them."""
    out = []
    for where, suffix in ((RESULTS_DIR, ""), (RESULTS_DIR / FORCED, f" [{FORCED.upper()} build]")):
        for bench in BENCHES:
            path = where / f"{bench.name}.json"
            if path.is_file():
                out += [{**f, "name": f["name"] + suffix} for f in bench.figures(json.loads(path.read_text()))]
    return out


def test_the_benches_figures_rebuild_the_committed_latest_json() -> None:
    latest = json.loads((RESULTS_DIR / "latest.json").read_text())
    committed = sorted((tuple(json.dumps(f[k]) for k in KEYS) for f in latest["figures"]))
    rebuilt = sorted((tuple(json.dumps(f[k]) for k in KEYS) for f in declared()))
    missing = {c[0] for c in committed} - {r[0] for r in rebuilt}
    extra = {r[0] for r in rebuilt} - {c[0] for c in committed}
    assert not missing and not extra, f"figures no bench declares: {missing}; new ones: {extra}"
    assert rebuilt == committed


def test_every_bench_declares_figures_under_its_own_name() -> None:
    names = {b.name for b in BENCHES}
    assert len(names) == len(BENCHES)
    for f in declared():
        assert f["bench"] in names, f
