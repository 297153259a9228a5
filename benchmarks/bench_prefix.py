"""Prefix cache and chunked prefill (issue 41), each side by side with itself switched off.

    .venv/bin/python -m benchmarks.bench_prefix [--rounds 3] [--turns 4] [--quick]

What it runs, and why: docs/benchmarks.md, "bench_prefix.py".
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.decode_paths import QUICK_SHAPE
from benchmarks.bench_residency import build_log
from benchmarks.harness import (Figure, figure, machine_info, median, output_flags, percentile,
    run_and_publish, spread)
from computed.model.loader import load_model
from computed.model.runner import Runner
from computed.replica import Replica
from computed.serving.engine import Engine
from computed.serving.rows import Request
from shared.client import ControlClient
from shared.fingerprint import read_model
from shared.replica_protocol import generate_args
from statesvc.tools.example import AdapterSpec, ModelShape, write_adapter, write_model
from testkit.fleet import StateSvc

SHAPE = ModelShape(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=4096)
ADAPTERS, RANK, TARGETS = 16, 8, ("q_proj", "v_proj")
BATCH, CHUNK = 32, 256  # running streams; prefill tokens a step while others decode
ROWS = 36  # rows of the KV cache: the 32 streams, the long prompt, and the native backend's quarters
TARGETS_X = {"ttft": 0.2, "throughput": 2.0, "itl": 0.5}


@dataclass(frozen=True)
class Sizes:
    max_len: int
    system: int  # tokens of the shared system prompt
    turn: int  # tokens of a user turn
    new: int  # new tokens per turn
    streams_new: int  # new tokens of each running stream
    long: int  # tokens of the long prompt


FULL = Sizes(max_len=2048, system=1024, turn=32, new=16, streams_new=64, long=1984)
QUICK = Sizes(max_len=256, system=128, turn=16, new=4, streams_new=24, long=224)


@dataclass
class Clock:
    """Per request: when it was submitted and when each of its tokens came."""

    sent: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, list[float]] = field(default_factory=dict)

    def on_token(self, req: Request, index: int, token: int, choice: int = 0, scores: Any = None) -> None:
        self.tokens.setdefault(req.req_id, []).append(time.perf_counter())

    def send(self, engine: Engine, req_id: str, args: dict[str, Any]) -> None:
        self.sent[req_id] = time.perf_counter()
        done = engine.submit(req_id, args, None)
        if done is not None:
            raise RuntimeError(f"{req_id} refused: {done.error}")


def engine_of(runner: Runner, replica: Replica, *, chunk: int, prefix_blocks: int) -> tuple[Engine, Clock]:
    engine = Engine(runner, replica, queue_limit=4 * ROWS, min_seq_wait_s=120, prefill_chunk=chunk,
                    prefix_blocks=prefix_blocks)
    engine.warm = True  # compiled by the first engine's warm-up: the jitted functions are shared
    clock = Clock()
    engine.on_token = clock.on_token
    return engine, clock


def step_until_idle(engine: Engine, on_done: Any = None) -> None:
    while engine.busy:
        for d in engine.step():
            if d.error is not None:
                raise RuntimeError(f"{d.req_id}: {d.error}")
            if on_done is not None:
                on_done(d.req_id)


def sessions(runner: Runner, replica: Replica, names: list[str], sizes: Sizes, turns: int,
             prefix: bool, rng: np.random.Generator) -> dict[str, Any]:
    """The shared-system-prompt workload, with the prefix cache or without: TTFTs and tokens/s."""
    blocks = ADAPTERS * (sizes.system // 16 + 8) if prefix else 0
    engine, clock = engine_of(runner, replica, chunk=CHUNK, prefix_blocks=blocks)
    system = [int(t) for t in rng.integers(3, runner.vocab_size, sizes.system)]
    user = rng.integers(3, runner.vocab_size, (len(names), turns, sizes.turn))
    done_turns = {name: 0 for name in names}

    def send(i: int, name: str) -> None:
        prompt = system + [int(t) for t in user[i, done_turns[name]]]
        clock.send(engine, f"{name}/{done_turns[name]}", generate_args(
            prompt, adapter=name, max_new_tokens=sizes.new, stream=True))

    def next_turn(req_id: str) -> None:
        name = req_id.split("/")[0]
        done_turns[name] += 1
        if done_turns[name] < turns:
            send(names.index(name), name)

    t0 = time.perf_counter()
    for i, name in enumerate(names):
        send(i, name)
    step_until_idle(engine, next_turn)
    seconds = time.perf_counter() - t0
    ttft = [(clock.tokens[r][0] - clock.sent[r]) * 1e3 for r in clock.sent]
    new = sum(len(v) for v in clock.tokens.values())
    cache = engine.prefills.cache
    return {"prefix": prefix, "seconds": seconds, "tokens": new, "tokens_per_s": new / seconds,
            "ttft_ms": {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99)},
            "hit_tokens": 0 if cache is None else cache.hit_tokens,
            "prompt_tokens": 0 if cache is None else cache.prompt_tokens}


def long_arrival(runner: Runner, replica: Replica, names: list[str], sizes: Sizes, chunked: bool,
                 rng: np.random.Generator) -> dict[str, Any]:
    """32 streams decoding, then a long prompt: the streams' inter-token gaps."""
    engine, clock = engine_of(runner, replica, chunk=CHUNK if chunked else 0, prefix_blocks=0)
    streams = [f"s{i}" for i in range(BATCH)]
    for i, req_id in enumerate(streams):
        clock.send(engine, req_id, generate_args([int(t) for t in rng.integers(3, runner.vocab_size, 32)],
                                                 adapter=names[i % len(names)], max_new_tokens=sizes.streams_new,
                                                 stream=True))
    while min(len(clock.tokens.get(r, [])) for r in streams) < 8:
        engine.step()
    clock.send(engine, "long", generate_args([int(t) for t in rng.integers(3, runner.vocab_size, sizes.long)],
                                             adapter=names[0], max_new_tokens=4, stream=True))
    step_until_idle(engine)
    gaps = [(b - a) * 1e3 for r in streams for a, b in zip(clock.tokens[r], clock.tokens[r][1:])]
    return {"chunked": chunked, "gaps": len(gaps), "itl_ms": {"p50": percentile(gaps, 50),
                                                               "p99": percentile(gaps, 99), "max": max(gaps)},
            "long_ttft_ms": (clock.tokens["long"][0] - clock.sent["long"]) * 1e3}


def run(args: argparse.Namespace) -> dict[str, Any]:
    shape, sizes = (QUICK_SHAPE, QUICK) if args.quick else (SHAPE, FULL)
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    rounds: dict[str, list[dict[str, Any]]] = {"sessions": [], "long": []}
    with tempfile.TemporaryDirectory(prefix="bench-prefix-") as tmp_s:
        tmp = Path(tmp_s)
        model_dir = write_model(tmp / "model", shape, seed=0)
        dirs = {f"a{i:02d}": write_adapter(tmp / f"a{i:02d}", AdapterSpec(
            f"a{i:02d}", r=RANK, lora_alpha=16, target_modules=TARGETS), shape, seed=i + 1,
            base_model_name_or_path="bench") for i in range(ADAPTERS)}
        build_log(tmp / "log", model_dir, list(dirs.items()), ADAPTERS)
        config, params = load_model(model_dir, "float32")
        runner = Runner(config, params, max_batch=ROWS, max_len=sizes.max_len, extend=True)
        svc = StateSvc(tmp / "log").start()
        try:
            with ControlClient(svc.control, timeout_s=60) as client:
                replica = Replica(read_model(model_dir), client, tmp / "replica")
                replica.bootstrap()
                names = sorted(dirs)
                warm = Engine(runner, replica, prefill_chunk=CHUNK, prefix_blocks=8)
                if not args.quick:  # a smoke run compiles what it runs as it runs it
                    t0 = time.perf_counter()
                    warm.warmup()
                    print(f"warm-up: {time.perf_counter() - t0:.0f} s", flush=True)
                for name in names:  # every adapter resident before anything is timed
                    assert warm.submit(name, generate_args([5, 6, 7], adapter=name, max_new_tokens=1), None) is None
                step_until_idle(warm)
                del warm
                unmeasured = 0 if args.quick else 1
                for i in range(1 - unmeasured, args.rounds + 1):
                    rng = np.random.default_rng(i)
                    pair = [sessions(runner, replica, names, sizes, args.turns, p, np.random.default_rng(i))
                            for p in ((True, False) if i % 2 else (False, True))]
                    longs = [long_arrival(runner, replica, names, sizes, c, rng)
                             for c in ((True, False) if i % 2 else (False, True))]
                    if i == 0:
                        continue  # unmeasured: caches, allocators, the kernels' first runs
                    rounds["sessions"].append({"on": next(p for p in pair if p["prefix"]),
                                               "off": next(p for p in pair if not p["prefix"])})
                    rounds["long"].append({"on": next(x for x in longs if x["chunked"]),
                                           "off": next(x for x in longs if not x["chunked"])})
                    s, lg = rounds["sessions"][-1], rounds["long"][-1]
                    print(f"round {i}: TTFT p50 {s['on']['ttft_ms']['p50']:.0f} / {s['off']['ttft_ms']['p50']:.0f} ms, "
                          f"{s['on']['tokens_per_s']:.0f} / {s['off']['tokens_per_s']:.0f} tokens/s; "
                          f"inter-token p99 {lg['on']['itl_ms']['p99']:.0f} / {lg['off']['itl_ms']['p99']:.0f} ms",
                          flush=True)
        finally:
            svc.stop()
    ratios = {
        "ttft_p50": [r["on"]["ttft_ms"]["p50"] / r["off"]["ttft_ms"]["p50"] for r in rounds["sessions"]],
        "throughput": [r["on"]["tokens_per_s"] / r["off"]["tokens_per_s"] for r in rounds["sessions"]],
        "itl_p99": [r["on"]["itl_ms"]["p99"] / r["off"]["itl_ms"]["p99"] for r in rounds["long"]]}
    figures = {k: median(v) for k, v in ratios.items()}
    return {
        "machine": machine_info(), "rounds": rounds, "ratios": ratios, "figures": figures,
        "settings": {"shape": shape.__dict__, "adapters": ADAPTERS, "rank": RANK, "targets": list(TARGETS),
                     "batch": BATCH, "chunk": CHUNK, "sizes": sizes.__dict__, "turns": args.turns,
                     "rounds": args.rounds, "quick": args.quick},
        "targets": [
            {"name": "shared system prompt, TTFT p50 with the prefix cache / without", "ratio": "ttft_p50",
             "measured": round(figures["ttft_p50"], 3), "target": f"<= {TARGETS_X['ttft']}x",
             "met": figures["ttft_p50"] <= TARGETS_X["ttft"]},
            {"name": "shared system prompt, tokens/s with the prefix cache / without", "ratio": "throughput",
             "measured": round(figures["throughput"], 2), "target": f">= {TARGETS_X['throughput']}x",
             "met": figures["throughput"] >= TARGETS_X["throughput"]},
            {"name": "long prompt among 32 streams, inter-token p99 chunked / whole", "ratio": "itl_p99",
             "measured": round(figures["itl_p99"], 3), "target": f"<= {TARGETS_X['itl']}x",
             "met": figures["itl_p99"] <= TARGETS_X["itl"]}],
        "load_average": {"before": load_before, "after": os.getloadavg()[0]},
        "seconds": time.perf_counter() - started}


def report(r: dict[str, Any]) -> str:
    from benchmarks.harness import target_lines
    s, m, f = r["settings"], r["machine"], r["figures"]
    z = s["sizes"]

    def mid(kind: str, side: str, *path: str) -> float:
        vals = []
        for x in r["rounds"][kind]:
            v: Any = x[side]
            for p in path:
                v = v[p]
            vals.append(v)
        return median(vals)
    lines = [
        "| workload | with | without | with / without | target |",
        "|---|---:|---:|---:|---|",
        f"| shared system prompt, TTFT p50 | {mid('sessions', 'on', 'ttft_ms', 'p50'):,.0f} ms | "
        f"{mid('sessions', 'off', 'ttft_ms', 'p50'):,.0f} ms | {f['ttft_p50']:.3f}x | <= {TARGETS_X['ttft']}x |",
        f"| shared system prompt, tokens/s | {mid('sessions', 'on', 'tokens_per_s'):,.0f} | "
        f"{mid('sessions', 'off', 'tokens_per_s'):,.0f} | {f['throughput']:.2f}x | >= {TARGETS_X['throughput']}x |",
        f"| long prompt among streams, inter-token p99 | {mid('long', 'on', 'itl_ms', 'p99'):,.0f} ms | "
        f"{mid('long', 'off', 'itl_ms', 'p99'):,.0f} ms | {f['itl_p99']:.3f}x | <= {TARGETS_X['itl']}x |",
        "", *target_lines(r), "",
        f"With: the prefix cache (first table rows; chunked prefill in both) or chunked prefill of "
        f"{s['chunk']} tokens a step (last row; no prefix cache in both). {s['adapters']} rank-{s['rank']} "
        f"adapters ({'+'.join(s['targets'])}), all resident, on a {s['shape']['num_hidden_layers']}-layer "
        f"hidden-{s['shape']['hidden_size']} model; 16 sessions x {s['turns']} turns of a {z['system']:,}-token "
        f"system prompt + {z['turn']}-token user turn, {z['new']} new tokens, closed loop per session; "
        f"{s['batch']} streams of {z['streams_new']} new tokens and a {z['long']:,}-token prompt arriving "
        f"once each has 8. Median of {s['rounds']} rounds' ratios, settings alternated in each "
        f"(`python -m benchmarks.bench_prefix`); on {m['cpu']}, {m['nproc']} CPUs; load average "
        f"{r['load_average']['before']:.1f} before, {r['load_average']['after']:.1f} after; {r['seconds']:.0f} s."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds (one more runs first, unmeasured)")
    ap.add_argument("--turns", type=int, default=4, help="turns per session")
    output_flags(ap, "prefix", "a tiny model and short prompts, for a smoke run")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.turns = 1, 2
    return run_and_publish("prefix", args, run, report)


def figures(r: dict[str, Any]) -> list[Figure]:
    """Issue 41: the prefix cache's TTFT and throughput, chunked prefill's inter-token p99, each
    with / without in the same rounds (bench_prefix); and the cached run's hit rate."""
    runs = r["settings"]["rounds"]
    out = [figure("prefix", t["name"], t["measured"], "x", target=t["target"], meets=t["met"],
                  spread=spread(r["ratios"][t["ratio"]]), runs=runs) for t in r["targets"]]
    on = [x["on"] for x in r["rounds"]["sessions"]]
    out.append(figure("prefix", "shared system prompt, prompt tokens served from the prefix cache",
                      100 * median([x["hit_tokens"] / x["prompt_tokens"] for x in on]), "%", runs=runs))
    return out


if __name__ == "__main__":
    raise SystemExit(main())
