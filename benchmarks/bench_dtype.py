"""Decode throughput of a bfloat16 model against the same model in float32, side by side in one run.

    .venv/bin/python -m benchmarks.bench_dtype [--steps 8] [--repeats 5] [--quick] [--no-write]

What it runs, and why: docs/benchmarks.md, "bench_dtype.py".
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.decode_paths import (BATCH, PROMPT, QUICK_SHAPE, RANK, SERVED_TOKENS, SHAPE, RawDecode, RequestTiming,
                                     ServedReplica, adapter_names, agreement, loaded_event, row_adapters,
                                     served_max_batch, write_assets)
from benchmarks.harness import (Figure, Timing, figure, machine_info, median, output_flags, run_and_publish,
                                spread)
from computed.model.loader import load_model
from computed.model.runner import Runner
from computed.residency.pool import MemoryPool, PoolSpec
from computed.residency.blob_cache import slot_weights
from shared.config import POOL_DTYPES
from testkit.jaxcount import counting_compiles

DTYPES = ("float32", "bfloat16")
MIXES = (0, 16)
TARGET = 1.0  # bfloat16 served decode over float32's


def run(args: argparse.Namespace) -> dict[str, Any]:
    shape = QUICK_SHAPE if args.quick else SHAPE
    max_len = PROMPT + 4 + (args.repeats + 2) * args.steps
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, shape.vocab_size, (BATCH, PROMPT)).astype(np.int32)
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-dtype-") as tmp:
        print("writing the bfloat16 checkpoint and adapters ...", flush=True)
        model_dir, dirs = write_assets(Path(tmp), shape, dtype="bfloat16")
        names = adapter_names()
        loops: dict[tuple[str, int], RawDecode] = {}
        info: dict[str, Any] = {}
        for dtype in DTYPES:
            config, params = load_model(model_dir, dtype)
            pool = MemoryPool(PoolSpec(num_layers=config.num_layers, module_dims=config.module_dims,
                                       slots=len(names) + 1, max_rank=RANK, dtype=args.pool_dtype))
            for slot, name in enumerate(names):
                data = (dirs[name] / "adapter_model.safetensors").read_bytes()
                pool.write_slot(slot, slot_weights(data, loaded_event(name, slot, data)))
            runner = Runner(config, params, max_batch=BATCH, max_len=max_len)
            if not args.quick:  # a smoke run's warm-up round compiles the few shapes it runs
                runner.warmup(pool.arrays, runner.new_cache())
            info[dtype] = {"backend": repr(params.backend),
                           "weight_bytes": sum(int(np.asarray(a).nbytes) for a in _leaves(params))}
            for k in MIXES:
                slots = np.array(row_adapters(k), np.int32)
                loops[dtype, k] = RawDecode(runner, pool, prompts, slots)
        served: dict[str, ServedReplica] = {}
        try:
            if args.served_clients:  # both replicas start side by side: their start-ups mostly wait
                print(f"starting a replica for each of {', '.join(DTYPES)} ...", flush=True)

                def start(dtype: str) -> ServedReplica:
                    return ServedReplica(Path(tmp), model_dir, dirs, prompts, clients=args.served_clients,
                                         new_tokens=args.served_tokens, max_len=PROMPT + args.served_tokens + 8,
                                         slots=len(names) + 1, pool_dtype=args.pool_dtype, dtype=dtype,
                                         name=f"served-{dtype}",
                                         max_batch=served_max_batch(args.quick, args.served_clients),
                                         warm=not args.quick)
                with ThreadPoolExecutor(len(DTYPES)) as starting:
                    started_replicas = {d: starting.submit(start, d) for d in DTYPES}
                for dtype, future in started_replicas.items():  # a failed start leaves none running
                    if future.exception() is None:
                        served[dtype] = future.result()
                for future in started_replicas.values():
                    future.result()
            timings = {key: Timing() for key in loops}
            served_t = {(d, k): RequestTiming() for d in served for k in MIXES}
            compiles: list[str] = []  # in the timed rounds
            for r in range(args.repeats + 1):
                count = r > 0  # round 0 warms up
                with counting_compiles() as seen:
                    for k in MIXES:
                        for dtype in DTYPES:
                            loops[dtype, k].round(args.steps, timings[dtype, k] if count else None)
                        for dtype, replica in served.items():
                            replica.round(k, served_t[dtype, k] if count else None)
                if count:
                    compiles += seen
                print(f"round {r}: " + ", ".join(
                    f"{d} k={k} {BATCH * args.steps / t.seconds[-1]:.0f}" for (d, k), t in timings.items()
                    if t.seconds), flush=True)
        finally:
            for replica in served.values():
                replica.stop()
    steps = args.steps
    result: dict[str, Any] = {"machine": machine_info(), "model": {"shape": shape.__dict__, "checkpoint": "bfloat16",
                                                                    **info},
                              "settings": {"steps": steps, "repeats": args.repeats, "pool_dtype": args.pool_dtype,
                                           "served_clients": args.served_clients, "served_tokens": args.served_tokens},
                              "compiles_while_timing": len(compiles), "decode": {}, "served": {}}
    for k in MIXES:
        rates = {d: [BATCH * steps / s for s in timings[d, k].seconds] for d in DTYPES}
        ratios = [b / f for b, f in zip(rates["bfloat16"], rates["float32"])]
        result["decode"][str(k)] = {
            **{d: {"tokens_per_s": median(v), "spread": spread(v)} for d, v in rates.items()},
            "bf16_over_f32": median(ratios), "bf16_over_f32_spread": spread(ratios),
            "token_agreement": agreement(loops["float32", k].tokens, loops["bfloat16", k].tokens)}
        if served:
            srates = {d: [served_t[d, k].rate(i) for i in range(args.repeats)] for d in DTYPES}
            sratios = [b / f for b, f in zip(srates["bfloat16"], srates["float32"])]
            result["served"][str(k)] = {
                **{d: {"tokens_per_s": median(v), "spread": spread(v)} for d, v in srates.items()},
                "bf16_over_f32": median(sratios), "bf16_over_f32_spread": spread(sratios),
                "target": TARGET, "pass": median(sratios) >= TARGET}
    result["seconds"] = round(time.perf_counter() - started, 1)
    result["load_average"] = {"before": load_before, "after": os.getloadavg()[0]}
    return result


def _leaves(params: Any) -> list[Any]:
    import jax
    return jax.tree.leaves(params)


def report(result: dict[str, Any]) -> str:
    """The bench:dtype section (docs/results-detail.md): a markdown table and the line saying where it ran."""
    m, model = result["machine"], result["model"]
    lines = ["| path | batch | float32 tokens/s | bfloat16 tokens/s | bfloat16 / float32 (spread) | target |",
             "|---|---|---:|---:|---:|---|"]
    for path in ("decode", "served"):
        for k, cell in result[path].items():
            label = "base model" if k == "0" else f"{k} distinct adapters"
            lo, hi = cell["bf16_over_f32_spread"]
            target = (f">= {TARGET}x: {'PASS' if cell['pass'] else 'MISS'}" if "pass" in cell
                      else f"tokens agree {cell['token_agreement']:.0%}")
            lines.append(f"| {'served' if path == 'served' else 'in process'} | {label} | "
                         f"{cell['float32']['tokens_per_s']:,.0f} | {cell['bfloat16']['tokens_per_s']:,.0f} | "
                         f"{cell['bf16_over_f32']:.2f}x ({lo:.2f}-{hi:.2f}) | {target} |")
    lines.append("")
    lines.append(f"The decode benchmark's model written in bfloat16, loaded as float32 "
                 f"({model['float32']['weight_bytes'] / 1e6:.0f} MB of weights) and as bfloat16 "
                 f"({model['bfloat16']['weight_bytes'] / 1e6:.0f} MB), batch {BATCH}, side by side in one run "
                 f"(`python -m benchmarks.bench_dtype`, {result['settings']['repeats']} rounds, medians); "
                 f"on {m['cpu']}, {m['nproc']} CPUs, kernels built for {', '.join(m['kernel_isas'])}; "
                 f"{result['compiles_while_timing']} compiles while timing; load average "
                 f"{result['load_average']['before']:.1f} before, {result['load_average']['after']:.1f} after "
                 "(other processes' load slows both models alike within a round; the ratios pair one round's).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--steps", type=int, default=8, help="decode steps per timed round")
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds (after one warm-up round)")
    ap.add_argument("--pool-dtype", choices=POOL_DTYPES, default="float32", help="the pool's dtype, both models")
    ap.add_argument("--served-clients", type=int, default=BATCH, help="served clients (0: no served path)")
    ap.add_argument("--served-tokens", type=int, default=SERVED_TOKENS, help="new tokens per served request")
    output_flags(ap, "dtype", "a tiny model, for a smoke run; writes only where "
                 "`python -m benchmarks --quick` says")
    args = ap.parse_args(argv)
    if args.quick:
        # as bench_decode's: 4 clients of 4 tokens, on a replica of --max-batch 4
        args.repeats, args.steps, args.served_clients, args.served_tokens = 1, 4, 4, 4
    return run_and_publish("dtype", args, run, report)


def figures(r: dict[str, Any]) -> list[Figure]:
    """bfloat16 model over float32 model, in process and served (issue 15: served >= 1.0x)."""
    out = []
    for path, label in (("decode", "decode"), ("served", "served")):
        for k, cell in r[path].items():
            mix = "base model" if k == "0" else f"{k} distinct adapters"
            target = cell.get("target")
            out.append(figure("dtype", f"{label}, {mix}: bfloat16 model / float32 model", cell["bf16_over_f32"], "x",
                              target=None if target is None else f">= {target}x", meets=cell.get("pass"),
                              spread=cell["bf16_over_f32_spread"], runs=r["settings"]["repeats"]))
    return out


if __name__ == "__main__":
    raise SystemExit(main())
