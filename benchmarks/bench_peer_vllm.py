"""Serving beside vLLM's CPU engine: both through the OpenAI API, same model, adapters, cores and requests, in one run.

    .venv/bin/python -m benchmarks.bench_peer_vllm [--rounds 3] [--tokens 64] [--per-stream 3]
        [--cpus 0-1] [--vllm-bind all|auto] [--log-dir build] [--quick] [--no-write] [--out FILE]

What it runs, and why: docs/benchmarks.md, "bench_peer_vllm.py".
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import (REPO, Figure, Fleet, alternate, cpu_model, figure, machine_info, median,
                                peer_output_flags, percentile, publish_peer, settle, spread)
from benchmarks.peer_vllm_server import (MAX_LEN, METRICS, SLOTS, Vllm, install_peer, peer_build, peer_dir,
                                         peer_python)

BATCH, PROMPT, RANK, ALPHA = 32, 32, 16, 32
ZIPF_ADAPTERS = 48  # registered for the Zipf stream: three times the slots
ZIPF_S = 1.1  # bench_residency's
TARGETS = {"adapters": (">=", 1.5), "base": (">=", 1.0), "zipf": (">=", 1.0)}
TARGET_TTFT = 1.0  # ours / vLLM TTFT p99 on the adapters burst, at most
WORKLOADS = {"adapters": "burst of 32, 16 adapters", "base": "burst of 32, base model",
             "closed": "32 streams closed loop, 16 adapters",
             "zipf": f"32 streams closed loop, Zipf over {ZIPF_ADAPTERS} adapters"}
SIDES = ("ours", "vllm")
Request = tuple[str, list[int], int]  # model (an adapter's name or the base model's), prompt ids, new tokens


def cpu_list() -> str:
    return ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))


def ours(root: Path, model_dir: Path, adapters: dict[str, Path], *, cpus: str) -> Fleet:
    """statesvc, one replica and the gateway, every adapter loaded, the pool on SLOTS slots."""
    return Fleet(root, model_dir, adapters=adapters, max_loras=SLOTS, max_rank=RANK, wrapper=("taskset", "-c", cpus),
                 replica_args=("--max-batch", str(BATCH), "--max-len", str(MAX_LEN)),
                 gateway=("--max-pending", str(4 * BATCH)))


# --------------------------------------------------------------------------- workloads


def requests(kind: str, seed: int, *, vocab: int, tokens: int, per_stream: int) -> list[Request]:
    """One round's requests of a workload (see the module's docstring)."""
    from benchmarks.residency_streams import zipf_stream

    rng = np.random.default_rng(seed)
    n = BATCH if kind in ("adapters", "base") else BATCH * per_stream
    prompts = [[int(t) for t in rng.integers(3, vocab, PROMPT)] for _ in range(n)]
    if kind in ("adapters", "base"):
        lengths = [tokens] * n
    else:
        lengths = [int(x) for x in rng.integers(max(1, tokens // 2), tokens * 3 // 2 + 1, n)]
    if kind == "base":
        names = ["model"] * n
    elif kind == "zipf":
        names = [f"a{r:02d}" for r in zipf_stream(ZIPF_ADAPTERS, n, ZIPF_S, rng)]
    else:
        names = [f"a{i % SLOTS:02d}" for i in range(n)]
    return list(zip(names, prompts, lengths))


class Client:
    """benchmarks/peer_vllm_client.py in a process of its own, on the same CPUs."""

    def __init__(self, cpus: str) -> None:
        self.proc = subprocess.Popen(["taskset", "-c", cpus, sys.executable, "-m", "benchmarks.peer_vllm_client"],
                                     cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def run(self, url: str, reqs: list[Request], concurrency: int) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"url": url, "reqs": reqs, "concurrency": concurrency}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the client exited (its traceback is above)")
        return dict(json.loads(line))

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(30)


def round_stats(got: dict[str, Any], reqs: list[Request], skip: int) -> dict[str, Any]:
    """One side's round: tokens/s over the whole round, latencies of the requests after `skip`."""
    ttft = got["ttft_s"][skip:]
    itl = [x for gaps in got["itl_s"][skip:] for x in gaps]
    tokens = sum(r[2] for r in reqs)
    return {"wall_s": got["wall_s"], "tok_s": tokens / got["wall_s"],
            "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p99_ms": 1e3 * percentile(ttft, 99),
            "itl_p50_ms": 1e3 * percentile(itl, 50), "itl_p99_ms": 1e3 * percentile(itl, 99),
            "client_cpu_s": got["cpu_s"]}


STATS = ("tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")


def cpu_count(cpus: str) -> int:
    """How many CPUs a taskset list names ("0,1", "0-3,6")."""
    return sum(int(b) - int(a) + 1 if (a := part.split("-")[0]) != (b := part.split("-")[-1]) else 1
               for part in cpus.split(","))


def summarize(rows: list[dict[str, Any]], ncpu: int) -> dict[str, Any]:
    out: dict[str, Any] = {side: {k: median(r[side][k] for r in rows) for k in STATS} for side in SIDES}
    for side in SIDES:
        out[side]["tok_s_spread"] = spread([r[side]["tok_s"] for r in rows])
        # the other side's servers' CPU while this side was measured, as a share of the CPUs
        other = SIDES[1 - SIDES.index(side)]
        out[side]["others_idle_cpu_share"] = max(r[side]["servers_cpu_s"][other] / (r[side]["wall_s"] * ncpu)
                                                 for r in rows)
    ratios = [r["ours"]["tok_s"] / r["vllm"]["tok_s"] for r in rows]
    ttft = [r["ours"]["ttft_p99_ms"] / r["vllm"]["ttft_p99_ms"] for r in rows]
    return {**out, "ours_over_vllm": median(ratios), "ours_over_vllm_spread": spread(ratios),
            "ttft_p99_ours_over_vllm": median(ttft), "ttft_p99_ours_over_vllm_spread": spread(ttft),
            "rounds_detail": rows}


# --------------------------------------------------------------------------- agreement


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict[str, float]:
    """Position by position; the share of each request's tokens before its first difference
    (after one, the two continue from different text); the share of requests identical."""
    from benchmarks.decode_paths import agreement as positions

    def prefix(a: list[int], b: list[int]) -> float:
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        return n / len(a)

    return {"positions": positions(ours, theirs),
            "prefix": float(np.mean([prefix(a, b) for a, b in zip(ours, theirs)])),
            "identical": float(np.mean([a == b for a, b in zip(ours, theirs)]))}


def greedy_tokens(ours: Fleet, vllm: Vllm, reqs: list[Request]) -> tuple[list[list[int]], list[list[int]]]:
    """Each request's greedy tokens from both, unstreamed, all at once on each side."""
    import httpx

    from shared.client import ControlClient
    from shared.replica_protocol import generate_args

    def our(r: Request) -> list[int]:
        with ControlClient(ours.replica.listen, timeout_s=300, retries=0) as c:
            res = c.call("generate", generate_args(r[1], adapter=None if r[0] == "model" else r[0],
                                                   max_new_tokens=r[2]))
        return [int(t) for t in res["output_ids"]]

    def their(r: Request) -> list[int]:
        body = {"model": r[0], "prompt": r[1], "max_tokens": r[2], "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        answer = httpx.post(vllm.url + "/v1/completions", json=body, timeout=300).raise_for_status().json()
        return [int(t) for t in answer["choices"][0]["token_ids"]]

    with ThreadPoolExecutor(len(reqs)) as pool:
        a = list(pool.map(our, reqs))
        b = list(pool.map(their, reqs))
    return a, b


# --------------------------------------------------------------------------- the run


def run(args: argparse.Namespace, py: Path) -> dict[str, Any]:
    from benchmarks.decode_paths import QUICK_SHAPE, SHAPE
    from shared.projections import MODULES
    from statesvc.tools.example import AdapterSpec, make_example

    shape = QUICK_SHAPE if args.quick else SHAPE
    if shape.head_dim < 32:
        raise SystemExit(f"head_dim {shape.head_dim}: vLLM's CPU attention needs 32 or more")
    if PROMPT + args.tokens * 3 // 2 > MAX_LEN:
        raise SystemExit(f"--tokens {args.tokens}: a {PROMPT}-token prompt and up to {args.tokens * 3 // 2} new "
                         f"tokens exceed the servers' max length {MAX_LEN}")
    cpus = args.cpus or cpu_list()
    started, load_before = time.perf_counter(), os.getloadavg()
    specs = tuple(AdapterSpec(f"a{i:02d}", r=RANK, lora_alpha=ALPHA, target_modules=tuple(MODULES))
                  for i in range(ZIPF_ADAPTERS))
    with tempfile.TemporaryDirectory(prefix="bench-peer-vllm-") as tmp_s:
        tmp = Path(tmp_s)
        print(f"writing the model and {ZIPF_ADAPTERS} adapters ...", flush=True)
        ex = make_example(tmp / "example", adapters=specs, shape=shape)
        ours_ = ours(tmp / "ours", ex.model_dir, ex.adapter_dirs, cpus=cpus)
        vllm = Vllm(py, ex.model_dir, ex.adapter_dirs, cpus=cpus, bind=args.vllm_bind,
                    log=args.log_dir / "vllm-serve.log")
        args.log_dir.mkdir(parents=True, exist_ok=True)
        client: Client | None = None
        servers: dict[str, Fleet | Vllm] = {"ours": ours_, "vllm": vllm}
        try:
            startup = {}
            for side in SIDES:
                print(f"starting {side} ...", flush=True)
                startup[side] = round(servers[side].start(), 1)
            print(f"started: ours in {startup['ours']} s, vLLM in {startup['vllm']} s", flush=True)
            client = Client(cpus)
            cells: dict[str, Any] = {}
            for w, label in WORKLOADS.items():
                burst = w in ("adapters", "base")
                rows = []
                load_w = os.getloadavg()[0]
                before = vllm.metrics()
                for r in range(args.rounds + 1):  # round 0 warms both (slot fills, connections)
                    reqs = requests(w, 1000 * (list(WORKLOADS).index(w) + 1) + r, vocab=shape.vocab_size,
                                    tokens=args.tokens, per_stream=args.per_stream)
                    order = alternate(SIDES, r)
                    got: dict[str, dict[str, Any]] = {}
                    for side in order:
                        settled = settle(lambda: sum(s.cpu_s() for s in servers.values()))
                        cpu0 = {s: servers[s].cpu_s() for s in SIDES}
                        got[side] = round_stats(client.run(servers[side].url, reqs, BATCH), reqs, 0 if burst else BATCH)
                        # each side's servers' CPU seconds in this side's round: the other's is what it
                        # took while idle, from the CPUs the measured side had
                        got[side]["servers_cpu_s"] = {s: servers[s].cpu_s() - cpu0[s] for s in SIDES}
                        got[side]["settled_s"] = settled
                    print(f"{w} round {r}{' (warm-up)' if r == 0 else ''}: " + ", ".join(
                        f"{s} {got[s]['tok_s']:.0f} tok/s TTFT p99 {got[s]['ttft_p99_ms']:.0f} ms "
                        f"ITL p50 {got[s]['itl_p50_ms']:.1f} ms" for s in SIDES), flush=True)
                    if r:
                        rows.append({**got, "first": order[0]})
                after = vllm.metrics()
                cells[w] = {"label": label, "requests": len(reqs), "load_average": [load_w, os.getloadavg()[0]],
                            **summarize(rows, cpu_count(cpus)), "vllm_metrics": {k.removeprefix("vllm:"): round(after[k] - before[k], 3)
                                                                for k in METRICS}}
            print("greedy agreement ...", flush=True)
            agree: dict[str, dict[str, float]] = {}
            for w in ("adapters", "base"):
                reqs = requests(w, 99_000 + len(agree), vocab=shape.vocab_size, tokens=args.tokens,
                                per_stream=args.per_stream)
                agree[w] = agreement(*greedy_tokens(ours_, vllm, reqs))
            engine = vllm.engine()
        finally:
            if client is not None:
                client.stop()
            for side in SIDES:
                servers[side].stop()
    result = {"machine": machine_info(), "cpu": f"{cpu_model()}, {os.cpu_count()} CPUs", "peer": "installed",
              "peer_build": peer_build(py), "vllm_engine": engine,
              "model": {"shape": {k: v for k, v in shape.__dict__.items() if k != "rope_scaling"}},
              "settings": {"rounds": args.rounds, "tokens": args.tokens, "per_stream": args.per_stream,
                           "batch": BATCH, "prompt": PROMPT, "rank": RANK, "slots": SLOTS,
                           "zipf_adapters": ZIPF_ADAPTERS, "zipf_s": ZIPF_S, "max_len": MAX_LEN, "cpus": cpus,
                           "vllm_bind": args.vllm_bind, "vllm_env": {k: vllm.env[k] for k in (
                               "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "LD_PRELOAD")},
                           "vllm_argv": vllm.argv[4:-ZIPF_ADAPTERS]},
              "startup_s": startup, "workloads": cells, "agreement": agree,
              "seconds": round(time.perf_counter() - started, 1),
              "load_average": {"before": list(load_before), "after": list(os.getloadavg())}}
    result["targets"] = targets(result)
    return result


def targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 39's targets, each a ratio of one run (`workload`, `stat`: the cell and figure it
    is read from; benchmarks/suite.py makes latest.json's figures of them)."""
    out = []
    for w, (_, goal) in TARGETS.items():
        v = r["workloads"][w]["ours_over_vllm"]
        out.append({"name": f"tokens/s, {WORKLOADS[w]}: ours / vLLM", "workload": w, "stat": "ours_over_vllm",
                    "measured": round(v, 3), "target": f">= {goal:g}x", "met": v >= goal})
    v = r["workloads"]["adapters"]["ttft_p99_ours_over_vllm"]
    out.append({"name": f"TTFT p99, {WORKLOADS['adapters']}: ours / vLLM", "workload": "adapters",
                "stat": "ttft_p99_ours_over_vllm", "measured": round(v, 3), "target": f"<= {TARGET_TTFT:g}x",
                "met": v <= TARGET_TTFT})
    return out


def report(r: dict[str, Any]) -> str:
    """The bench:vllm section (docs/results-detail.md)."""
    if r.get("peer") != "installed":
        return f"vLLM peer: {r.get('peer')} ({r.get('why', '')}); no figures in this run."
    s, e, b = r["settings"], r.get("vllm_engine", {}), r["peer_build"]
    lines = ["| workload | ours tok/s | vLLM tok/s | ours / vLLM (spread) | TTFT p50 / p99 ms, ours | "
             "TTFT p50 / p99 ms, vLLM | ITL p50 / p99 ms, ours | ITL p50 / p99 ms, vLLM |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for w, c in r["workloads"].items():
        o, v = c["ours"], c["vllm"]
        lo, hi = c["ours_over_vllm_spread"]
        goal = TARGETS.get(w)
        verdict = f"; >= {goal[1]:g}x: {'PASS' if c['ours_over_vllm'] >= goal[1] else 'MISS'}" if goal else ""
        lines.append(f"| {c['label']} | {o['tok_s']:,.0f} | {v['tok_s']:,.0f} | {c['ours_over_vllm']:.2f}x "
                     f"({lo:.2f}-{hi:.2f}){verdict} | {o['ttft_p50_ms']:,.0f} / {o['ttft_p99_ms']:,.0f} "
                     f"| {v['ttft_p50_ms']:,.0f} / {v['ttft_p99_ms']:,.0f} | {o['itl_p50_ms']:.1f} / "
                     f"{o['itl_p99_ms']:.1f} | {v['itl_p50_ms']:.1f} / {v['itl_p99_ms']:.1f} |")
    t = r["workloads"]["adapters"]["ttft_p99_ours_over_vllm"]
    lo, hi = r["workloads"]["adapters"]["ttft_p99_ours_over_vllm_spread"]
    la = r["load_average"]

    def account(c: dict[str, Any]) -> str:
        m = c["vllm_metrics"]
        n = m["request_success_total"] or 1
        return (f"queue {1e3 * m['request_queue_time_seconds_sum'] / n:,.0f}, prefill "
                f"{1e3 * m['request_prefill_time_seconds_sum'] / n:,.0f}, decode "
                f"{1e3 * m['request_decode_time_seconds_sum'] / n:,.0f} ms a request; prefix cache "
                f"{m['prefix_cache_hits_total']:,.0f} of {m['prefix_cache_queries_total']:,.0f} tokens hit; "
                f"{m['num_preemptions_total']:,.0f} preemptions")

    lines += ["", f"TTFT p99 on the 16-adapter burst, ours / vLLM: {t:.2f}x ({lo:.2f}-{hi:.2f}; <= {TARGET_TTFT:g}x: "
              f"{'PASS' if t <= TARGET_TTFT else 'MISS'}). Greedy tokens agree (fresh prompts, unstreamed; ours from "
              "the replica's `generate`, vLLM's `return_token_ids`; float32 both): " + "; ".join(
                  f"{w} {x['positions']:.0%} of positions, {x['prefix']:.0%} of each request before its first "
                  f"difference, {x['identical']:.0%} of requests identical" for w, x in r["agreement"].items())
              + ". While one side was measured the other's servers, idle, used at most " + ", ".join(
                  f"{max(c['vllm' if side == 'ours' else 'ours']['others_idle_cpu_share'] for c in r['workloads'].values()):.1%}"
                  f" of the CPUs ({'ours' if side == 'ours' else 'vLLM'} idle)" for side in SIDES)
              + f". Startup to healthy: ours {r['startup_s']['ours']} s (statesvc, {s['zipf_adapters']} loads, replica warm-up, "
              f"gateway), vLLM {r['startup_s']['vllm']} s.",
              "", "vLLM's own account of its timed and warm-up rounds (its /metrics): " + "; ".join(
                  f"{c['label']}: {account(c)}" for c in r["workloads"].values()) + ".",
              "", f"vllm-cpu {b.get('vllm_cpu', '?')} (torch {b.get('torch', '?')}), its OpenAI server with "
              f"`--enable-lora --max-loras {s['slots']} --max-cpu-loras {s['zipf_adapters']} --max-num-seqs "
              f"{s['batch']}`, float32; prefix caching {e.get('enable_prefix_caching', '?')}, chunked prefill "
              f"{e.get('enable_chunked_prefill', '?')}, compilation {e.get('compilation_mode', '?')} (vLLM's CPU "
              f"platform with LoRA on), OpenMP on cores {e.get('omp_cores', '?')}, `LD_PRELOAD="
              f"{s['vllm_env']['LD_PRELOAD']}`. Ours: statesvc, one `computed serve --max-batch {s['batch']}` "
              f"({s['slots']} slots, host tier) and the gateway. Every process on CPUs {s['cpus']}; "
              f"{s['rounds']} rounds after a warm-up, sides alternating first; {s['prompt']} prompt tokens, "
              f"{s['tokens']} new (closed loops {s['tokens'] // 2}-{s['tokens'] * 3 // 2}, {s['per_stream']} a "
              f"stream), greedy, `ignore_eos`; Zipf s={s['zipf_s']} over {s['zipf_adapters']} adapters; medians; "
              f"on {r['cpu']}; load average {la['before'][0]:.1f} before, {la['after'][0]:.1f} after. "
              "`python -m benchmarks.bench_peer_vllm` reproduces it; docs/benchmarks.md, \"vLLM side by side\", "
              "says what it does and does not measure."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per workload (after one warm-up round)")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per request (the closed loops: 1/2 to 3/2 of it)")
    ap.add_argument("--per-stream", type=int, default=3, help="requests per stream in the closed loops")
    ap.add_argument("--cpus", default="", help="taskset CPU list for every process (default: all of ours)")
    ap.add_argument("--vllm-bind", choices=("all", "auto"), default="all",
                    help="vLLM's OpenMP threads on every CPU of --cpus (all), or vLLM's own choice (auto: "
                         "one CPU per physical core, minus one reserved for its API server and scheduler)")
    ap.add_argument("--log-dir", type=Path, default=REPO / "build",
                    help="where vLLM's server log goes, as vllm-serve.log (default: build/, git-ignored)")
    peer_output_flags(ap, "vllm", "the tiny model, one round of 8 tokens; never installs the peer")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.tokens, args.per_stream = 1, 8, 2
    venv = peer_dir()
    py = peer_python(venv)
    result: dict[str, Any]
    base = {"machine": machine_info(), "cpu": f"{cpu_model()}, {os.cpu_count()} CPUs"}
    if py is None and args.quick:
        result = {**base, "peer": "not installed", "why": f"no vllm in {venv}"}
    elif py is None and (got := install_peer(venv))[0] is None:
        result = {**base, "peer": "install failed", "why": got[1]}
    else:
        result = run(args, py or venv / "bin" / "python")
    return publish_peer("vllm", result, report(result), args)


def figures(r: dict[str, Any]) -> list[Figure]:
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


if __name__ == "__main__":
    raise SystemExit(main())
