"""Tensor-parallel replicas (issue 19): bytes per device, and decode throughput beside N = 1.

    .venv/bin/python -m benchmarks.bench_tp [--steps 8] [--repeats 5] [--quick] [--no-write]

What it runs, and why: docs/benchmarks.md, "bench_tp.py".
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import Figure, figure, machine_info, median, output_flags, run_and_publish, spread
from shared.projections import MODULES
from statesvc.tools.example import AdapterSpec, ModelShape, make_example

SHAPE = ModelShape(vocab_size=2048, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=256)
QUICK_SHAPE = ModelShape(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, head_dim=16)
ADAPTERS, BATCH, RANK, PROMPT = 16, 32, 8, 8
QUICK_BATCH = 4
DEGREES = (1, 2, 4)


def worker(n: int, root: Path, steps: int, repeats: int, batch: int) -> None:
    """In a process with n devices: its bytes per device (one JSON line once warm), then one
    round of decode steps per line read from stdin, each answered with its seconds."""
    import jax

    from computed.backend import XlaBackend
    from computed.model import sharding
    from computed.model.loader import load_model
    from computed.model.runner import Runner
    from computed.residency.pool import MemoryPool, PoolSpec, SlotWeights

    assert len(jax.devices()) == n, f"{len(jax.devices())} devices, asked for {n}"
    config, params = (load_model(root / "model", backend=XlaBackend()) if n == 1
                      else load_model(root / "model", tensor_parallel=n))
    spec = PoolSpec(num_layers=config.num_layers, module_dims=config.module_dims, slots=ADAPTERS,
                    max_rank=RANK, dtype="float32")
    mesh = getattr(params.backend, "mesh", None)
    pool = MemoryPool(spec, shardings=None if mesh is None else sharding.pool_shardings(spec, mesh))
    rng = np.random.default_rng(0)
    for s in range(ADAPTERS):  # random rank-RANK adapters on every module: throughput, not parity
        pairs = {(layer, m): (rng.standard_normal((RANK, i), np.float32) * 0.01,
                              rng.standard_normal((o, RANK), np.float32) * 0.01)
                 for layer in range(config.num_layers) for m, (i, o) in config.module_dims.items()}
        pool.write_slot(s, SlotWeights(scaling=2.0, rank=RANK, pairs=pairs))
    max_len = PROMPT + (repeats + 1) * steps + 1
    runner = Runner(config, params, max_batch=batch, max_len=max_len)
    cache = runner.new_cache()
    slots = np.arange(batch, dtype=np.int32) % ADAPTERS
    prompts = [list(rng.integers(0, config.vocab_size, PROMPT)) for _ in range(batch)]
    runner.warmup(pool.shapes(), cache)  # every attention bucket and LoRA window: nothing compiles below
    logits, cache = runner.prefill(pool.arrays, cache, prompts, list(range(batch)), slots.tolist())
    tokens, pos, active = logits.argmax(-1).astype(np.int32), np.full(batch, PROMPT, np.int32), np.ones(batch, bool)
    weights, pool_bytes = sharding.device_bytes(params), sharding.device_bytes(pool.arrays)
    formula = {"weights": sharding.expected_param_bytes(params, n), "pool": sharding.expected_pool_bytes(spec, n, 4)}
    say({"n": n, "devices": len(weights),
         "weights_bytes_per_device": sorted(set(weights.values())),
         "pool_bytes_per_device": sorted(set(pool_bytes.values())),
         "weights_formula": formula["weights"], "pool_formula": formula["pool"],
         "weights_total": sum(a.nbytes for a in jax.tree.leaves(params)),
         "pool_total": sum(a.nbytes for a in jax.tree.leaves(pool.arrays)),
         "exact": set(weights.values()) == {formula["weights"]} and set(pool_bytes.values()) == {formula["pool"]}})
    for line in sys.stdin:  # one round of `steps` decode steps per line, until stdin closes
        start = time.perf_counter()
        for _ in range(steps):
            logits, cache = runner.decode(pool.arrays, cache, tokens, pos, slots, active)
            tokens, pos = logits.argmax(-1).astype(np.int32), pos + 1
        say({"seconds": time.perf_counter() - start})


def say(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


def ask(proc: subprocess.Popen[str], line: str | None) -> dict[str, Any]:
    """Send a worker `line` (None: nothing) and read its JSON answer."""
    assert proc.stdin is not None and proc.stdout is not None
    if line is not None:
        proc.stdin.write(line + "\n")
        proc.stdin.flush()
    answer = proc.stdout.readline()
    if not answer:
        raise SystemExit(f"a worker exited with {proc.wait()} (its stderr is above)")
    out: dict[str, Any] = json.loads(answer)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    shape = QUICK_SHAPE if args.quick else SHAPE
    # a smoke run: 2 steps, one round, 4 rows (each worker's warm-up compiles per row bucket)
    steps, repeats, batch = (2, 1, QUICK_BATCH) if args.quick else (args.steps, args.repeats, BATCH)
    degrees = DEGREES[:2] if args.quick else DEGREES  # a smoke run: one mesh beside N = 1, each figure kind
    adapters = (AdapterSpec("a0", r=RANK, lora_alpha=16, target_modules=MODULES),)  # the worker writes its own 16
    per_n: dict[str, Any] = {}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        make_example(Path(tmp), shape=shape, adapters=adapters)
        procs = {}
        for n in degrees:  # started one after another: their warm-ups do not compete
            env = {**os.environ, "XLA_FLAGS": " ".join(
                [os.environ.get("XLA_FLAGS", ""), f"--xla_force_host_platform_device_count={n}"]).strip()}
            procs[n] = subprocess.Popen([sys.executable, "-m", "benchmarks.bench_tp", "--worker", str(n), tmp,
                                         "--steps", str(steps), "--repeats", str(repeats),
                                         "--batch", str(batch)],
                                        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            per_n[str(n)] = {**ask(procs[n], None), "seconds": []}
        try:
            for r in range(repeats + 1):  # round by round, the order rotating; the first warms up
                for n in degrees[r % len(degrees):] + degrees[:r % len(degrees)]:
                    seconds = ask(procs[n], "round")["seconds"]
                    if r:
                        per_n[str(n)]["seconds"].append(seconds)
        finally:
            for proc in procs.values():
                assert proc.stdin is not None
                proc.stdin.close()
                proc.wait(timeout=60)
    for cell in per_n.values():
        cell["tokens_per_s"] = [batch * steps / t for t in cell["seconds"]]
        # per round, beside N = 1's rate in the same round
        ratios = [a / b for a, b in zip(cell["tokens_per_s"], per_n["1"]["tokens_per_s"])]
        cell["over_one"], cell["over_one_spread"] = median(ratios), spread(ratios)
    return {"machine": machine_info(), "model": shape.__dict__,
            "load_average": {"before": load_before, "after": os.getloadavg()[0]},
            "settings": {"steps": steps, "repeats": repeats, "batch": batch, "adapters": ADAPTERS, "rank": RANK,
                         "devices": "forced CPU host devices (overhead, not speed-up)"},
            "results": per_n,
            "targets": [{"name": f"bytes per device = formula, N = {k}", "measured": str(c["exact"]),
                         "target": "exact", "met": c["exact"]} for k, c in per_n.items()]}


def report(r: dict[str, Any]) -> str:
    m, s = r["machine"], r["settings"]
    lines = [f"Tensor-parallel replicas on {m.get('cpu', 'this CPU')} ({m.get('nproc', '?')} CPUs), "
             f"N forced host devices sharing those cores: the ratio is the mesh's overhead, not a speed-up. "
             f"Decode of {s['batch']} rows over {s['adapters']} adapters (rank {s['rank']}, every module), "
             f"{s['steps']} steps x {s['repeats']} rounds, the three N interleaved round by round, medians "
             f"(ratios per round); N = 1 is the XLA backend on one device; "
             f"load average {r['load_average']['before']:.1f} before, {r['load_average']['after']:.1f} after.", "",
             "| N | weights / device (formula) | pool / device (formula) | exact | decode tokens/s | / N = 1 |",
             "|---|---|---|---|---|---|"]
    for k, c in r["results"].items():
        rate = c["tokens_per_s"]
        lines.append(f"| {k} | {c['weights_bytes_per_device'][0]:,} ({c['weights_formula']:,}) "
                     f"| {c['pool_bytes_per_device'][0]:,} ({c['pool_formula']:,}) | {c['exact']} "
                     f"| {median(rate):,.0f} (spread {', '.join(f'{v:,.0f}' for v in spread(rate))}) "
                     f"| {c['over_one']:.2f}x ({'-'.join(f'{v:.2f}' for v in c['over_one_spread'])}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--steps", type=int, default=8, help="decode steps per timed round")
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds (after one warm-up round)")
    ap.add_argument("--worker", nargs=2, metavar=("N", "DIR"), help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=BATCH, help=argparse.SUPPRESS)  # the worker's rows
    output_flags(ap, "tp", f"a smoke run: a tiny model, {QUICK_BATCH} rows, one round")
    args = ap.parse_args(argv)
    if args.worker:
        worker(int(args.worker[0]), Path(args.worker[1]), args.steps, args.repeats, args.batch)
        return 0
    return run_and_publish("tp", args, run, report)


def figures(r: dict[str, Any]) -> list[Figure]:
    """Issue 19: bytes per device against the formula, decode beside N = 1 (forced CPU devices)."""
    out = []
    for k, c in r["results"].items():
        if k == "1":
            continue
        worst = max(max(c[f"{w}_bytes_per_device"]) / c[f"{w}_formula"] for w in ("weights", "pool"))
        out.append(figure("tp", f"tensor-parallel {k}: bytes per device / formula (weights and pool)",
                          worst, "x", target="1.0x", meets=c["exact"]))
        out.append(figure("tp", f"tensor-parallel {k} on forced CPU devices: decode, 16 adapters / N = 1",
                          c["over_one"], "x", spread=c["over_one_spread"], runs=len(c["tokens_per_s"])))
    return out


if __name__ == "__main__":
    raise SystemExit(main())
