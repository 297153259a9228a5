"""The OpenAI-compatible gateway against ZeroMQ straight to the replica, side by side in one run.

    .venv/bin/python -m benchmarks.bench_gateway [--runs bench:split,bench:shared,tiny:split]
        [--rounds 5] [--quick] [--no-write] [--profile DIR]

What it runs, and why: docs/benchmarks.md, "bench_gateway.py".
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import (Figure, Fleet, cpu_model, figure, machine_info, median, output_flags, percentile,
    publish, spread)
from shared.projections import MODULES
from statesvc.tools.example import AdapterSpec, ModelShape, make_example

BATCH, ADAPTERS = 32, 16
STEADY_ROUNDS, STEADY_PER_STREAM = 3, 3  # a steady stream: 3 requests a stream, 32 streams


@dataclass(frozen=True)
class Workload:
    shape: ModelShape
    rank: int
    modules: tuple[str, ...]
    prompt: int
    tokens: int


def workloads() -> dict[str, Workload]:
    from benchmarks.decode_paths import SHAPE
    return {"bench": Workload(SHAPE, 16, tuple(MODULES), 32, 64),
            "tiny": Workload(ModelShape(), 8, ("q_proj", "v_proj"), 8, 32)}


def cpu_s(pid: int) -> float:
    """A process's CPU seconds so far, all its threads (their schedstat: nanoseconds, where
    /proc/PID/stat counts 10 ms ticks)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # a thread that ended meanwhile
    return total / 1e9


Request = tuple[str, list[int], int]  # adapter, prompt ids, new tokens


@dataclass(frozen=True)
class Layout:
    """Which CPUs the processes run on: `shared`, every process on every CPU (the replica's
    compute threads take all of them during a step); `split`, the replica on all CPUs but
    the last, the gateway and the client on the last (the front door on a core of its own,
    as it would sit on a host of its own in front of a fleet)."""

    name: str
    replica: tuple[str, ...] = ()  # a command prefix: `taskset -c CPUS`
    front: tuple[str, ...] = ()

    @staticmethod
    def shared() -> Layout:
        return Layout("shared")

    @staticmethod
    def split() -> Layout:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2 or shutil.which("taskset") is None:
            raise SystemExit("a split layout needs 2 CPUs or more and `taskset` (util-linux); "
                             "run with --runs bench:shared,tiny:shared instead")
        rest = ",".join(str(c) for c in cpus[:-1])
        return Layout("split", ("taskset", "-c", rest), ("taskset", "-c", str(cpus[-1])))


LAYOUTS = {"split": Layout.split, "shared": Layout.shared}
LAYOUT_LABELS = {"split": "gateway on a CPU of its own", "shared": "all on all CPUs"}


def requests(w: Workload, seed: int, n: int = BATCH, vary: bool = False) -> list[Request]:
    """n requests, adapter i % 16, random prompts; `vary`: new tokens drawn uniformly from
    half to one and a half times the workload's (the same mean), so that streams in a
    closed loop end, and start again, at different steps."""
    rng = np.random.default_rng(seed)
    return [(f"a{i % ADAPTERS:02d}", [int(t) for t in rng.integers(3, w.shape.vocab_size, w.prompt)],
             int(rng.integers(w.tokens // 2, w.tokens * 3 // 2 + 1)) if vary else w.tokens)
            for i in range(n)]


def measure(name: str, w: Workload, rounds: int, profile: Path | None,
            lone_n: int = BATCH, steady_rounds: int = STEADY_ROUNDS, *,
            layout: Layout) -> dict[str, Any]:
    load_before = os.getloadavg()[0]
    slug = name.replace(", ", "-").replace(" ", "-")
    root = Path(tempfile.mkdtemp(prefix=f"bench-gateway-{slug}-"))
    specs = tuple(AdapterSpec(f"a{i:02d}", r=w.rank, lora_alpha=2 * w.rank,
                              target_modules=w.modules) for i in range(ADAPTERS))
    ex = make_example(root / "example", adapters=specs, shape=w.shape)
    fleet = Fleet(root, ex.model_dir, adapters={x.name: ex.adapter_dirs[x.name] for x in specs}, max_loras=ADAPTERS,
                  max_rank=w.rank, replica_args=("--max-batch", str(BATCH), "--max-len", "256"),
                  replica_wrapper=layout.replica, gateway=("--max-pending", str(4 * BATCH)),
                  gateway_wrapper=layout.front)
    replica = fleet.replica
    gateway = fleet.gateway
    assert gateway is not None
    if profile is not None:
        profile.mkdir(parents=True, exist_ok=True)
        os.environ["LORAPLANE_GATEWAY_PROFILE"] = str(profile.resolve() / f"gateway-{slug}.prof")
    client: subprocess.Popen[str] | None = None
    try:
        fleet.start()
        os.environ.pop("LORAPLANE_GATEWAY_PROFILE", None)
        client = subprocess.Popen([*layout.front, sys.executable, "-m", "benchmarks.gateway_client",
                                   replica.listen, gateway.url], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        assert client.stdin is not None and client.stdout is not None
        pids = {"replica": replica.pid, "gateway": gateway.pid}

        def send(path: str, reqs: list[Request], concurrency: int) -> dict[str, Any]:
            assert client is not None and client.stdin is not None and client.stdout is not None
            client.stdin.write(json.dumps({"path": path, "reqs": reqs,
                                           "concurrency": concurrency}) + "\n")
            client.stdin.flush()
            return dict(json.loads(client.stdout.readline()))

        def run(path: str, reqs: list[Request], skip: int = 0) -> dict[str, Any]:
            """All of reqs, BATCH streams at a time; latencies of those after the first
            `skip` (a steady stream's first wave starts at once, as a burst)."""
            before = {k: cpu_s(pid) for k, pid in pids.items()}
            got = send(path, reqs, BATCH)
            cpu = {k: cpu_s(pid) - before[k] for k, pid in pids.items()}
            cpu["client"] = got["cpu_s"]
            lat, over, ttft = got["lat_s"][skip:], got["over_s"][skip:], got["ttft_s"][skip:]
            tokens = sum(r[2] for r in reqs)
            return {"wall_s": got["wall_s"], "tok_s": tokens / got["wall_s"],
                    "p50_ms": 1e3 * percentile(lat, 50), "p99_ms": 1e3 * percentile(lat, 99),
                    "outside_p50_ms": 1e3 * percentile(over, 50),
                    "outside_p99_ms": 1e3 * percentile(over, 99),
                    "outside_ms": [round(1e3 * x, 3) for x in over],
                    "ttft_p50_ms": 1e3 * percentile(ttft, 50),
                    "cpu_ms_per_token": {k: 1e3 * v / tokens for k, v in cpu.items()}}

        rows = []
        for r in range(rounds + 1):  # round 0 warms both paths (slot fills, connections)
            reqs = requests(w, r)
            order = ["zmq", "gateway"] if r % 2 else ["gateway", "zmq"]
            got = {m: run(m, reqs) for m in order}
            if r:
                rows.append(got)
        # a steady stream: BATCH streams in a closed loop, lengths varied, so that requests
        # arrive and end at different steps; its first wave (sent at once) is not counted
        steady = []
        for r in range(steady_rounds):
            reqs = requests(w, 1000 + r, STEADY_PER_STREAM * BATCH, vary=True)
            order = ["zmq", "gateway"] if r % 2 else ["gateway", "zmq"]
            steady.append({m: run(m, reqs, skip=BATCH) for m in order})
        # lone requests, one at a time, alternating the path: the hop without the burst
        lone: dict[str, list[float]] = {"zmq": [], "gateway": []}
        for i, req in enumerate(requests(w, rounds + 1)[:lone_n]):
            for m in (["zmq", "gateway"] if i % 2 else ["gateway", "zmq"]):
                lone[m] += send(m, [req], 1)["over_s"]
    finally:
        if client is not None:
            client.stdin.close()  # type: ignore[union-attr]
            client.wait(30)
        fleet.stop()
    ratios = [r["gateway"]["tok_s"] / r["zmq"]["tok_s"] for r in rows]
    steady_ratios = [r["gateway"]["tok_s"] / r["zmq"]["tok_s"] for r in steady]
    return {
        "layout": layout.name,
        "load_average": {"before": load_before, "after": os.getloadavg()[0]},
        "rounds": rounds, "batch": BATCH, "adapters": ADAPTERS, "rank": w.rank,
        "prompt_tokens": w.prompt, "new_tokens": w.tokens,
        "model": {"vocab_size": w.shape.vocab_size, "hidden_size": w.shape.hidden_size,
                  "layers": w.shape.num_hidden_layers},
        "rounds_detail": rows,
        "zmq_tok_s": median(r["zmq"]["tok_s"] for r in rows),
        "gateway_tok_s": median(r["gateway"]["tok_s"] for r in rows),
        "ratio": median(ratios), "ratio_range": spread(ratios),
        "added_p50_ms": median(added(r, "p50") for r in rows),
        "added_p99_ms": median(added(r, "p99") for r in rows),
        "e2e_added_p50_ms": median(r["gateway"]["p50_ms"] - r["zmq"]["p50_ms"] for r in rows),
        "e2e_added_p99_ms": median(r["gateway"]["p99_ms"] - r["zmq"]["p99_ms"] for r in rows),
        "added_ttft_p50_ms": median(r["gateway"]["ttft_p50_ms"] - r["zmq"]["ttft_p50_ms"]
                                 for r in rows),
        "steady": {"rounds": len(steady), "streams": BATCH,
                   "requests": STEADY_PER_STREAM * BATCH, "counted": (STEADY_PER_STREAM - 1) * BATCH,
                   "new_tokens": [w.tokens // 2, w.tokens * 3 // 2], "rounds_detail": steady,
                   **({"ratio": median(steady_ratios), "ratio_range": spread(steady_ratios),
                       "added_p50_ms": median(added(r, "p50") for r in steady),
                       "added_p99_ms": median(added(r, "p99") for r in steady),
                       "zmq_outside_p50_ms": median(r["zmq"]["outside_p50_ms"] for r in steady)}
                      if steady else {})},
        "lone": {"requests": len(lone["zmq"]),
                 "outside_ms": {m: [1e3 * x for x in v] for m, v in lone.items()},
                 **{f"added_{q}_ms": 1e3 * percentile(lone["gateway"], n)
                    for q, n in (("p50", 50), ("p99", 99))},
                 "zmq_outside_p50_ms": 1e3 * percentile(lone["zmq"], 50)},
        "cpu_ms_per_token": {path: {k: median(r[path]["cpu_ms_per_token"][k] for r in rows)
                                    for k in ("replica", "gateway", "client")}
                             for path in ("zmq", "gateway")},
    }


def added(row: dict[str, Any], q: str) -> float:
    """One round's added latency at quantile q ("p50", "p99"): the gateway path's latency
    less its upstream time."""
    return float(row["gateway"][f"outside_{q}_ms"])


def worst_p50(rows: list[dict[str, Any]]) -> float:
    """The largest added p50 of any round: the target holds only if it holds in every
    round."""
    return max(added(x, "p50") for x in rows)


def report(res: dict[str, Any]) -> str:
    """The bench:gateway section (docs/results-detail.md)."""
    lines = ["| model | workload | ZeroMQ tok/s | gateway tok/s | gateway / ZeroMQ (spread) | "
             "added p50 | added p99 | CPU ms/token: replica, gateway | load average |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for name, r in res["shapes"].items():
        m, (lo, hi) = r["model"], r["ratio_range"]
        cpu = r["cpu_ms_per_token"]
        target = name == res["shape"]
        where = LAYOUT_LABELS.get(r.get("layout", "shared"), "")
        label = (f"{r.get('shape', name)} (hidden {m['hidden_size']}, {m['layers']} layers; "
                 f"{r['prompt_tokens']}+{r['new_tokens']} tokens), {where}")
        load = f"{r['load_average']['before']:.1f} / {r['load_average']['after']:.1f}"
        lines.append(
            f"| {label} | burst: {r['batch']} at once | {r['zmq_tok_s']:,.0f} | "
            f"{r['gateway_tok_s']:,.0f} | {r['ratio']:.2f}x ({lo:.2f}-{hi:.2f})"
            + (f"; >= 0.9x: {'PASS' if r['ratio'] >= 0.9 else 'MISS'}" if target else "")
            + f" | {r['added_p50_ms']:+.2f} ms | {r['added_p99_ms']:+.2f} ms | "
            f"{cpu['gateway']['replica']:.3f}, {cpu['gateway']['gateway']:.3f} "
            f"(idle: {cpu['zmq']['gateway']:.3f}) | {load} |")
        st = r.get("steady") or {}
        if st.get("rounds"):
            slo, shi = st["ratio_range"]
            lines.append(
                f"| {label} | steady: {st['streams']} streams, {st['counted']} requests a round"
                f" | | | {st['ratio']:.2f}x ({slo:.2f}-{shi:.2f}) | {st['added_p50_ms']:+.2f} ms"
                + (f"; < 2 ms in every round: "
                   f"{'PASS' if worst_p50(st['rounds_detail']) < 2 else 'MISS'}"
                   if target else "")
                + f" | {st['added_p99_ms']:+.2f} ms | | |")
        lone = r["lone"]
        lines.append(f"| {label} | lone: {lone['requests']} one at a time | | | | "
                     f"{lone['added_p50_ms']:+.2f} ms | {lone['added_p99_ms']:+.2f} ms | | |")
    first = next(iter(res["shapes"].values()))
    lo_tokens, hi_tokens = first["steady"]["new_tokens"]
    lines += ["", f"{BATCH} streaming requests over {ADAPTERS} resident adapters, greedy, "
              "sent by ZeroMQ straight to one replica (`stream: true`) and as streaming "
              "`/v1/completions` through the gateway, from a client in its own process, "
              "rounds alternating which path goes first. Burst: the same "
              f"{BATCH} requests sent at once, {first['rounds']} rounds (the throughput "
              "target's). Steady: "
              f"{BATCH} streams in a closed loop, each sending its next request when its last "
              f"one ends, new tokens drawn from {lo_tokens}-{hi_tokens}, the first wave not "
              f"counted, {first['steady']['rounds']} rounds (the added-latency target's). "
              "Lone: one request "
              "at a time. Added latency: each request's latency through the gateway less the "
              "gateway's upstream time for it (sent to the replica to its result); medians "
              "over rounds. `bench` is the decode benchmark's model and the targets' workload, "
              "`tiny` the example model (the gateway's worst case). Gateway on a CPU of its "
              "own: the replica pinned to the other CPUs, the gateway and the client to the "
              "last one (`taskset`), as a front door sits in front of a fleet; the targets "
              "are this layout's. All on all CPUs: the replica's compute threads and the "
              "gateway share every CPU, so the gateway's figures also hold the wait for a "
              f"CPU the replica's step keeps busy. On {res['cpu']}. "
              "`python -m benchmarks.bench_gateway` reproduces it; docs/gateway.md says what "
              "the figures mean."]
    return "\n".join(lines)


RUNS = "bench:split,bench:shared,tiny:split"  # the first is the targets'


def run_key(shape: str, layout: str) -> str:
    """A run's key in the results: the shape's name, with the layout unless it is split."""
    return shape if layout == "split" else f"{shape}, {layout} CPUs"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", default=RUNS,
                   help="comma-separated SHAPE:LAYOUT, each its own fleet, the first the "
                   "targets'; SHAPE bench or tiny, LAYOUT split (the gateway and the client on "
                   "a CPU of their own) or shared (every process on every CPU)")
    p.add_argument("--rounds", type=int, default=5, help="burst rounds")
    p.add_argument("--steady-rounds", type=int, default=STEADY_ROUNDS,
                   help="rounds of the steady stream (the added-latency target's)")
    p.add_argument("--tokens", type=int, default=None, help="new tokens (default: per shape)")
    output_flags(p, "gateway", "the tiny model only, split, one round of 8 tokens; writes only "
                 "where `python -m benchmarks --quick` says")
    p.add_argument("--profile", type=Path, default=None,
                   help="run the gateway under cProfile, one DIR/gateway-SHAPE.prof per shape")
    a = p.parse_args(argv)
    if a.quick:
        a.runs, a.rounds, a.tokens = "tiny:split", 1, 8
    known = workloads()
    runs = [tuple(r.split(":", 1)) if ":" in r else (r, "split") for r in a.runs.split(",")]
    if not all(shape in known and layout in LAYOUTS for shape, layout in runs):
        p.error(f"--runs takes SHAPE:LAYOUT, SHAPE one of {', '.join(known)}, LAYOUT one of "
                f"{', '.join(LAYOUTS)}")
    res: dict[str, Any] = {"cpu": f"{cpu_model()}, {os.cpu_count()} CPUs", "machine": machine_info(), "shapes": {}}
    for shape, layout in runs:
        w = known[shape]
        if a.tokens:
            w = Workload(w.shape, w.rank, w.modules, w.prompt, a.tokens)
        key = run_key(shape, layout)
        res["shapes"][key] = {**measure(key, w, a.rounds, a.profile, 4 if a.quick else BATCH,
                                        1 if a.quick else a.steady_rounds,
                                        layout=LAYOUTS[layout]()), "shape": shape}
    # the figures with targets (benchmarks/suite.py) are the first run's
    first = run_key(*runs[0])
    res.update({k: v for k, v in res["shapes"][first].items() if k != "model"}, shape=first)
    markdown = report(res)
    print(markdown)
    print(json.dumps({n: r["cpu_ms_per_token"] for n, r in res["shapes"].items()}, indent=1))
    publish("gateway", res, markdown, quick=a.quick, no_write=a.no_write, say=print)
    return 0


def figures(r: dict[str, Any]) -> list[Figure]:
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


if __name__ == "__main__":
    raise SystemExit(main())
