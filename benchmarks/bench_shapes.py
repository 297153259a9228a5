"""Speed at the shapes users serve (issue 48): a real model's geometry beside this machine's floors.

    .venv/bin/python -m benchmarks.bench_shapes [--preset qwen2.5-0.5b] [--repeats 5] [--quick] [--no-write]

What it runs, and why: docs/benchmarks.md, "bench_shapes.py".
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from benchmarks.harness import Figure, figure, machine_info, median, output_flags, run_and_publish, spread
from computed.backend import native
from computed.model.loader import load_model
from computed.model.packed import PackedWeight
from computed.model.runner import Runner
from computed.residency.blob_cache import slot_weights
from computed.residency.pool import MemoryPool, PoolSpec
from shared.client import ControlClient, new_event_id
from shared.events import AdapterLoaded
from statesvc.tools.example import ModelShape, make_example
from statesvc.tools.presets import PRESETS, Preset
from testkit.fleet import Computed, StateSvc, wait_for

DEFAULT_PRESET = "qwen2.5-0.5b"
QUICK = Preset("llama", ModelShape(vocab_size=512, hidden_size=128, intermediate_size=352,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=32, tie_word_embeddings=True))
BATCH, ADAPTERS, RANK, POSITION, PREFILL = 32, 16, 16, 64, 256
SERVE = ("--dtype", "bfloat16", "--max-batch", str(BATCH), "--max-len", "2048")
QUICK_SERVE = ("--dtype", "bfloat16", "--max-batch", "2", "--max-len", "32", "--no-prefix-cache")
STARTUP_TIMEOUT_S = 1800.0


def matrix_isa() -> str:
    """The CPU's widest matrix ISA, as /proc/cpuinfo names it: AMX-BF16, AVX-512-BF16 or AVX2."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return "unknown"
    return next((label for flag, label in (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX-512-BF16"),
                                           ("avx512f", "AVX-512F"), ("avx2", "AVX2")) if flag in flags), "none")


def example(preset_name: str, preset: Preset, quick: bool) -> Path:
    """The preset's checkpoint and 16 adapters, written once into build/bench-models/ (a quick
    run's into a temp dir) and reused while the preset is unchanged."""
    spec = json.dumps([preset.family, repr(preset.shape), preset.config, preset.dtype, ADAPTERS], sort_keys=True)
    tag = hashlib.sha256(spec.encode()).hexdigest()[:12]
    root = (Path(tempfile.mkdtemp(prefix="bench-shapes-")) if quick else
            Path(__file__).resolve().parents[1] / "build" / "bench-models" / f"{preset_name}-{tag}")
    if not (root / "done").exists():
        shutil.rmtree(root, ignore_errors=True)
        make_example(root, family=preset.family, shape=preset.shape, dtype=preset.dtype, config=preset.config,
                     adapters=preset.adapters(ADAPTERS, rank=RANK), base_model_name_or_path=f"random-{preset_name}")
        (root / "done").write_text(spec)
    return root


def read_bandwidth(threads: int) -> float:
    """GB/s reading 1 GiB, split over `threads` threads, best of 5."""
    data = np.ones(2**28, np.float32)
    parts = np.array_split(data, threads)
    best = 0.0
    for _ in range(5):
        workers = [threading.Thread(target=np.add.reduce, args=(p,)) for p in parts]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = max(best, data.nbytes / (time.perf_counter() - t0) / 1e9)
    return best


def timed(fn: Callable[[], Any], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        out.append(time.perf_counter() - t0)
    return out


def gemm_rate(weights: list[PackedWeight], rows: int) -> float:
    """FLOP/s of the dense kernel multiplying `rows` bfloat16 rows by `weights` in one call."""
    x = jax.numpy.asarray(np.random.default_rng(0).standard_normal((rows, weights[0].n_in), np.float32),
                          jax.numpy.bfloat16)
    run = jax.jit(lambda x, ws: native.dense_matmuls(x, ws))
    seconds = timed(lambda: run(x, weights), 8)[1:]
    return sum(2 * rows * w.n_in * w.out for w in weights) / median(seconds)


# XLA's own dot on the same bfloat16 shapes, in a process of its own (XLA_FLAGS are read at start):
# plain, and through the oneDNN library jaxlib links (`--xla_cpu_use_onednn`), which takes AMX tiles
# where the CPU has them
XLA_DOT = """
import json, sys, time
import jax, jax.numpy as jnp, numpy as np
rows, n_in, out = (int(v) for v in sys.argv[1:4])
rng = np.random.default_rng(0)
x = jnp.asarray(rng.standard_normal((rows, n_in), np.float32), jnp.bfloat16)
w = jnp.asarray(rng.standard_normal((n_in, 2 * out), np.float32), jnp.bfloat16)
f = jax.jit(lambda x, w: jax.lax.dot(x, w, preferred_element_type=jnp.float32))
f(x, w).block_until_ready()
times = []
for _ in range(7):
    t0 = time.perf_counter(); f(x, w).block_until_ready(); times.append(time.perf_counter() - t0)
print(json.dumps(2 * rows * n_in * 2 * out / sorted(times)[3]))
"""
XLA_DOT_FLAGS = {"xla dot": "", "xla dot, oneDNN": "--xla_cpu_use_onednn=true"}


def xla_dot_rate(rows: int, n_in: int, out: int, flags: str) -> float:
    """FLOP/s of XLA's dot of `rows` bfloat16 rows by [n_in, 2 out] (gate and up side by side)."""
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()}
    done = subprocess.run([sys.executable, "-c", XLA_DOT, str(rows), str(n_in), str(out)], env=env,
                          capture_output=True, text=True, timeout=600, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def product_sizes(params: Any) -> list[tuple[int, int]]:
    """(in, out) of every dense product of a forward (the layers', then the LM head)."""
    sizes = [w.shape for layer in params.layers for w in layer.weights.values()]
    head = params.lm_head if params.lm_head is not None else params.embed.T
    return [(int(a), int(b)) for a, b in sizes] + [tuple(int(d) for d in head.shape)]  # type: ignore[misc]


def measure_model(model_dir: Path, adapter_dirs: dict[str, Path], repeats: int, quick: bool) -> dict[str, Any]:
    config, params = load_model(model_dir, "bfloat16")
    pool = MemoryPool(PoolSpec(num_layers=config.num_layers, module_dims=config.module_dims,
                               slots=ADAPTERS, max_rank=RANK, dtype="bfloat16"))
    for slot, (name, d) in enumerate(sorted(adapter_dirs.items())):
        data = (d / "adapter_model.safetensors").read_bytes()
        event = AdapterLoaded(name=name, version=slot + 2, sha256="", size=len(data), rank=RANK, alpha=2.0 * RANK,
                              scaling=2.0, use_rslora=False, targets=tuple(config.module_dims), pinned=False)
        pool.write_slot(slot, slot_weights(data, event))
    max_len = 2 * PREFILL + POSITION
    runner = Runner(config, params, max_batch=BATCH, max_len=max_len)
    arrays, cache = pool.arrays, runner.new_cache()
    weight_bytes = sum(int(a.nbytes) for a in jax.tree.leaves(params))
    sizes = product_sizes(params)
    mlp = [w for w in (params.layers[0].weights.get("gate_proj"), params.layers[0].weights.get("up_proj"))
           if isinstance(w, PackedWeight)]
    rates = {rows: gemm_rate(mlp, rows) for rows in (PREFILL, BATCH)} if mlp else {}
    gate = params.layers[0].weights["gate_proj"]
    xla = {} if quick else {  # a smoke run spares the four processes
        label: {str(rows): xla_dot_rate(rows, gate.shape[0], gate.shape[1], flags) for rows in (PREFILL, BATCH)}
        for label, flags in XLA_DOT_FLAGS.items()}

    prompts = np.random.default_rng(1).integers(0, config.vocab_size, (BATCH, POSITION), np.int32)
    mixes = {"base": np.full(BATCH, -1, np.int32), "16 adapters": np.arange(BATCH, dtype=np.int32) % ADAPTERS}
    tokens, positions, active = prompts[:, -1], np.full(BATCH, POSITION, np.int32), np.ones(BATCH, np.bool_)
    _, cache = runner.prefill(arrays, cache, list(prompts), list(range(BATCH)), [-1] * BATCH)
    steps: dict[str, list[float]] = {k: [] for k in mixes}
    for round_ in range(repeats + 1):  # a warm-up round (it compiles), then the timed ones, alternated
        for name, slots in mixes.items():
            times = []
            for _ in range(4):
                t0 = time.perf_counter()
                logits, cache = runner.decode(arrays, cache, tokens, positions, slots, active)
                times.append(time.perf_counter() - t0)
            if round_:
                steps[name].append(median(times))
    prompt = np.random.default_rng(2).integers(0, config.vocab_size, PREFILL, np.int32)
    prefill_s = []
    for _ in range(repeats + 1):  # the first compiles
        t0 = time.perf_counter()
        _, cache = runner.prefill(arrays, cache, [prompt], [0], [-1])
        prefill_s.append(time.perf_counter() - t0)
    prefill_s = prefill_s[1:]
    layer_flops = 2 * PREFILL * sum(a * b for a, b in sizes[:-1])
    attn_flops = 2 * PREFILL * PREFILL * config.num_heads * config.head_dim * config.num_layers  # QK and PV, causal half
    prefill_flops = layer_flops + attn_flops + 2 * sizes[-1][0] * sizes[-1][1]
    return {"params": int(sum(np.prod(a.shape) for a in jax.tree.leaves(params))), "weight_bytes": weight_bytes,
            "step_flops": 2 * BATCH * sum(a * b for a, b in sizes), "prefill_flops": prefill_flops,
            "gemm_flops": {str(k): v for k, v in rates.items()}, "xla_dot_flops": xla, "decode_s": steps,
            "prefill_s": prefill_s}


def startup(model_dir: Path, adapter_dirs: dict[str, Path], quick: bool, tmp: Path) -> dict[str, Any]:
    """A first start and a restart of a real replica, each until its status says ready."""
    svc = StateSvc(tmp / "data")
    # the replica keys its own cache in --cache-dir: not `make test`'s session cache
    replica = Computed(model_dir, svc, tmp / "replica", replica_id="shapes", env={"JAX_COMPILATION_CACHE_DIR": ""},
                       extra_args=QUICK_SERVE if quick else SERVE)
    runs: list[dict[str, Any]] = []
    try:
        svc.start()
        with ControlClient(svc.control, timeout_s=120) as c:
            c.call("pool.init", {"event_id": new_event_id(), "model": str(model_dir), "max_loras": ADAPTERS,
                                 "max_rank": RANK, "targets": "all", "dtype": "bfloat16"})
            for name, d in sorted(adapter_dirs.items()):
                c.call("load", {"event_id": new_event_id(), "name": name, "path": str(d)})
        for which in ("first start", "restart"):
            t0 = time.perf_counter()
            replica.start()
            wait_for(lambda: replica.status()["inference"]["state"] == "ready", timeout=STARTUP_TIMEOUT_S,
                     what=f"the replica's {which}")
            seconds = time.perf_counter() - t0
            wait_for(lambda: not replica.status()["inference"]["warmup"]["pending"], timeout=STARTUP_TIMEOUT_S,
                     what=f"the rest of the replica's compiles ({which})")
            inference = replica.status()["inference"]
            runs.append({"start": which, "seconds": seconds, "all_compiled_s": time.perf_counter() - t0,
                         "warmup": inference["warmup"], "memory": inference["memory"]})
            replica.stop()
    finally:
        replica.stop()
        svc.stop()
    return {"runs": runs, "args": list(QUICK_SERVE if quick else SERVE)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    name = "quick" if args.quick else args.preset
    preset = QUICK if args.quick else PRESETS[args.preset]
    root = example(name, preset, args.quick)
    model_dir = root / "model"
    adapter_dirs = {p.name: p for p in sorted((root / "adapters").iterdir())}
    repeats = 1 if args.quick else args.repeats
    bandwidth = read_bandwidth(os.cpu_count() or 1)
    measured = measure_model(model_dir, adapter_dirs, repeats, args.quick)
    with tempfile.TemporaryDirectory(prefix="bench-shapes-serve-") as tmp:
        served = startup(model_dir, adapter_dirs, args.quick, Path(tmp))
    if args.quick:
        shutil.rmtree(root, ignore_errors=True)
    return {"machine": {**machine_info(), "matrix_isa": matrix_isa()}, "preset": name,
            "shape": {"family": preset.family, **{k: v for k, v in vars(preset.shape).items() if k != "rope_scaling"}},
            "read_gb_s": bandwidth, **measured, "startup": served, "figures": figures_of(measured, bandwidth, served)}


def figures_of(m: dict[str, Any], bandwidth: float, served: dict[str, Any]) -> dict[str, Any]:
    """The headline figures: each a value with its target where the issue sets one."""
    floor_s = m["weight_bytes"] / (bandwidth * 1e9)
    out: dict[str, Any] = {"weights_floor_ms": floor_s * 1e3}
    for mix, seconds in m["decode_s"].items():
        s = median(seconds)
        out[f"decode {mix}"] = {"ms": s * 1e3, "spread_ms": [v * 1e3 for v in spread(seconds)],
                                "tokens_s": BATCH / s, "over_weights_floor": s / floor_s}
        if str(BATCH) in m["gemm_flops"]:
            out[f"decode {mix}"]["over_flop_floor"] = s / (m["step_flops"] / m["gemm_flops"][str(BATCH)])
    p = median(m["prefill_s"])
    out["prefill"] = {"tokens_s": PREFILL / p, "gflop_s": m["prefill_flops"] / p / 1e9}
    if str(PREFILL) in m["gemm_flops"]:
        out["prefill"]["of_gemm_peak"] = m["prefill_flops"] / p / m["gemm_flops"][str(PREFILL)]
    for r in served["runs"]:
        mem = r["memory"]
        out[r["start"]] = {**(r["warmup"] or {}), "seconds": r["seconds"], "all_compiled_s": r["all_compiled_s"],
                           "rss_gb": mem["rss"] / 1e9,
                           "unexplained_gb": max(0, mem["other"]) / 1e9}
    return out


def render(r: dict[str, Any]) -> str:
    f, m = r["figures"], r["machine"]
    lines = [f"Preset {r['preset']} ({r['params'] / 1e6:,.0f} M parameters, {r['weight_bytes'] / 1e9:.2f} GB as "
             f"loaded), {m['cpu']}, {m['nproc']} CPUs, matrix ISA {m['matrix_isa']}, kernels built for "
             f"{', '.join(m['kernel_isas']) or 'none'}. Read bandwidth {r['read_gb_s']:.1f} GB/s; dense kernel "
             + ", ".join(f"{float(v) / 1e9:.0f} GFLOP/s at {k} rows" for k, v in r["gemm_flops"].items())
             + "".join(f"; {label} " + ", ".join(f"{v / 1e9:.0f}" for v in rates.values()) + " GFLOP/s"
                       for label, rates in r["xla_dot_flops"].items()) + ".",
             "", "| figure | value | target |", "|---|---:|---|"]
    for mix in ("base", "16 adapters"):
        d = f[f"decode {mix}"]
        lines.append(f"| decode, batch {BATCH}, {mix}: ms a step ({d['tokens_s']:.0f} tokens/s) | {d['ms']:.1f} | |")
        lines.append(f"| same / weights-read floor ({f['weights_floor_ms']:.1f} ms) | {d['over_weights_floor']:.2f}x | <= 1.5x |")
        if "over_flop_floor" in d:
            lines.append(f"| same / FLOP floor at the kernel's rate | {d['over_flop_floor']:.2f}x | |")
    p = f["prefill"]
    lines.append(f"| prefill, {PREFILL}-token prompt: tokens/s ({p['gflop_s']:.0f} GFLOP/s) | {p['tokens_s']:.0f} | |")
    if "of_gemm_peak" in p:
        lines.append(f"| same / the kernel's GEMM rate at {PREFILL} rows | {p['of_gemm_peak']:.0%} | >= 50% |")
    for which, target in (("first start", "<= 60 s"), ("restart", "<= 15 s")):
        s = f[which]
        lines.append(f"| {which} until ready, s (all compiled at {s['all_compiled_s']:.0f} s: {s.get('compiles', '?')} "
                     f"compiles, {s.get('cache_hits', '?')} from the cache) | {s['seconds']:.1f} | {target} |")
    s = f["restart"]
    lines.append(f"| replica RSS, GB (unexplained beside weights, KV, prefix store, pool, host tier) | "
                 f"{s['rss_gb']:.2f} ({s['unexplained_gb']:.2f}) | <= 1 GB unexplained |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default=DEFAULT_PRESET)
    ap.add_argument("--repeats", type=int, default=5)
    output_flags(ap, "shapes", "a smoke run: the tiny example shape, one round, a small replica")
    args = ap.parse_args()
    name = "shapes" if args.preset == DEFAULT_PRESET or args.quick else f"shapes-{args.preset}"
    return run_and_publish(name, args, run, render)


def figures(r: dict[str, Any]) -> list[Figure]:
    """Issue 48, at a real geometry (bench_shapes): decode beside the weights-read floor, prefill
    beside the dense kernel's GEMM rate, first start and restart until ready, RSS unexplained.
    Each names the preset and the CPU's matrix ISA."""
    f, where = r["figures"], f"{r['preset']}, {r['machine'].get('matrix_isa', '?')}"
    out = []
    for mix in ("base", "16 adapters"):
        d, runs = f[f"decode {mix}"], len(r["decode_s"][mix])
        out.append(figure("shapes", f"decode {where}, batch 32, {mix}", d["tokens_s"], "tokens/s", runs=runs))
        out.append(figure("shapes", f"decode {where}, batch 32, {mix}: step / weights-read floor",
                          d["over_weights_floor"], "x", target="<= 1.5x", meets=d["over_weights_floor"] <= 1.5,
                          runs=runs))
    p = f["prefill"]
    if "of_gemm_peak" in p:
        out.append(figure("shapes", f"prefill {where}, 256 tokens: FLOP/s / the dense kernel's at 256 rows",
                          100 * p["of_gemm_peak"], "%", target=">= 50", meets=p["of_gemm_peak"] >= 0.5,
                          runs=len(r["prefill_s"])))
    for which, limit in (("first start", 60), ("restart", 15)):
        out.append(figure("shapes", f"replica {which} until ready, {where}", f[which]["seconds"], "s",
                          target=f"<= {limit}", meets=f[which]["seconds"] <= limit))
    out.append(figure("shapes", f"replica RSS unexplained by its parts, {where}", f["restart"]["unexplained_gb"],
                      "GB", target="<= 1", meets=f["restart"]["unexplained_gb"] <= 1))
    return out


if __name__ == "__main__":
    raise SystemExit(main())
