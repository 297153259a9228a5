"""Figure and target records, their verdicts, latest.json's summary table and the README's headline.

A bench keeps its targets as records in its results (name, target, measured, met);
the suite turns each bench's results into figures (`figure`: one headline ratio or rate, the
median of the bench's runs with their spread) through the bench's own `figures` function.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.harness.machine import FORCED

Figure = dict[str, Any]


def figure(bench: str, name: str, value: float, unit: str, *, target: str | None = None,
           meets: bool | None = None, spread: list[float] | None = None,
           runs: int = 1) -> Figure:
    return {"name": name, "value": round(float(value), 4), "unit": unit, "target": target,
            "meets": meets, "spread": None if spread is None else [round(v, 4) for v in spread],
            "runs": runs, "bench": bench}


def _measured(t: dict[str, Any]) -> str:
    return f"{t['measured']:,}" if isinstance(t["measured"], (int, float)) else str(t["measured"])


def target_lines(result: dict[str, Any]) -> list[str]:
    """The README's verdicts, one markdown line per entry of `result["targets"]`."""
    return [f"- {'PASS' if t['met'] else 'MISS'}: {t['name']} {_measured(t)} (target {t['target']})"
            for t in result["targets"]]


def num(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"


def verdict(f: Figure) -> str:
    if f["meets"] is None:
        return ""
    if f["meets"]:
        return "PASS"
    return f"MISS ({shortfall(f)})"


def shortfall(f: Figure) -> str:
    """How far a missed figure is from its target, in the target's own terms."""
    goal_text = str(f["target"]).replace(",", "").rstrip("x")
    op, _, bound = goal_text.rpartition(" ")
    try:
        goal = float(bound)
    except ValueError:
        return f"measured {num(f['value'])}, target {f['target']}"
    if goal == 0:
        return f"{num(f['value'])} instead of 0"
    if op == ">=":
        return f"{f['value'] / goal:.0%} of the target"
    if f["value"] < goal and f["spread"]:  # a target that every run must meet
        return f"the median is under it, runs up to {num(f['spread'][1])}"
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
        value = f"{num(f['value'])}{'x' if f['unit'] == 'x' else unit}"
        span = "" if not f["spread"] else f"{num(f['spread'][0])}-{num(f['spread'][1])}"
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
    if latest["plots"]:  # the table's page is docs/results.md: the plots are one folder up
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
