"""Decode throughput beside the CPU's peer: llama.cpp on the same model, prompts and machine, in one run.

    .venv/bin/python -m benchmarks.bench_peer_llamacpp [--steps 16] [--repeats 5] [--quick] [--no-write]
                                                       [--out FILE]

What it runs, and why: docs/benchmarks.md, "bench_peer_llamacpp.py".
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import (Figure, REPO, figure, machine_info, median, peer_output_flags,
    publish_peer, spread)

VENV_ENV = "LORAPLANE_LLAMACPP_VENV"
PEER_VERSION = "0.3.36"  # llama-cpp-python, the sdist pip resolves (vendors llama.cpp)
# a native build: -march=native (AVX-512 here); GGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=OFF ... for AVX2
CMAKE_ARGS = ("-DGGML_NATIVE=ON -DGGML_BLAS=OFF -DGGML_CUDA=OFF -DLLAMA_BUILD_TESTS=OFF "
              "-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF")
ADAPTER_MIX = 16
TARGET_BASE = 1.0
TARGET_ADAPTERS = 3.0
CONTENDED = 0.10  # bench_decode's: a round where other processes used more of the CPUs is disturbed
WORKLOADS = (("f32", 0), ("f32", ADAPTER_MIX), ("bf16", 0))
# llama.cpp's two ways to run adapter groups (setup's "mode"), the faster one is the figure
MODES = {"contexts": "one llama context per adapter, its 2 rows, adapter set once",
         "switch": "one llama context for all 32 rows, adapter switched before each group's decode"}


# `make bench ISA=avx2` (LORAPLANE_KERNEL_ISA=avx2) pairs our forced-AVX2 kernels with an AVX2 peer
CMAKE_ARGS_AVX2 = CMAKE_ARGS.replace("-DGGML_NATIVE=ON", "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON "
                                     "-DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF")


def forced_avx2() -> bool:
    return os.environ.get("LORAPLANE_KERNEL_ISA") == "avx2"


def peer_dir() -> Path:
    """$LORAPLANE_LLAMACPP_VENV, else build/llamacpp-venv (build/llamacpp-venv-avx2 for a forced AVX2 run)."""
    default = REPO / "build" / ("llamacpp-venv-avx2" if forced_avx2() else "llamacpp-venv")
    return Path(os.environ.get(VENV_ENV) or default)


def peer_python(venv: Path) -> Path | None:
    """The peer venv's python when llama_cpp and gguf import there, else None."""
    py = venv / "bin" / "python"
    if not py.is_file():
        return None
    ok = subprocess.run([str(py), "-c", "import llama_cpp, gguf"], capture_output=True).returncode == 0
    return py if ok else None


def build_peer(venv: Path) -> tuple[Path | None, str]:
    """Create the venv and compile llama-cpp-python into it (about 10 minutes on 2 cores)."""
    log = venv.parent / "llamacpp-build.log"
    venv.parent.mkdir(parents=True, exist_ok=True)
    print(f"building the peer into {venv} (llama-cpp-python {PEER_VERSION}, CMAKE_ARGS="
          f"{CMAKE_ARGS_AVX2 if forced_avx2() else CMAKE_ARGS}); "
          f"log in {log} ...", flush=True)
    cmake_args = CMAKE_ARGS_AVX2 if forced_avx2() else CMAKE_ARGS
    env = {**os.environ, "CMAKE_ARGS": cmake_args, "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 1)}
    with open(log, "w") as f:
        for cmd in (["python3", "-m", "venv", str(venv)],
                    [str(venv / "bin" / "pip"), "install", "--no-cache-dir", f"llama-cpp-python=={PEER_VERSION}",
                     "gguf"]):
            if subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT).returncode != 0:
                return None, f"peer build failed ({' '.join(cmd[:3])} ...): see {log}"
    (venv / "build-info.json").write_text(json.dumps({"llama_cpp_python": PEER_VERSION, "cmake_args": cmake_args}))
    return peer_python(venv), "built"


class Peer:
    """The worker process in the peer's venv, one JSON line each way."""

    def __init__(self, py: Path, log: Path) -> None:
        self.log = open(log, "w")
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen([str(py), "-m", "benchmarks.peer_llamacpp_worker"], cwd=REPO, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)

    def call(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the llama.cpp worker exited (see {self.log.name})")
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"llama.cpp worker: {reply['error']} (log: {self.log.name})")
        return reply

    def stop(self) -> None:
        try:
            self.call(op="quit")
        except (RuntimeError, OSError, json.JSONDecodeError):
            pass
        self.proc.wait(timeout=30)
        self.log.close()


def convert(py: Path, *args: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([str(py), "-m", "benchmarks.gguf_convert", *args], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"gguf_convert {' '.join(args[:2])}: {done.stdout}{done.stderr}")


def modes(w: tuple[str, int]) -> tuple[str, ...]:
    """llama.cpp's modes for a workload: both for adapter groups, one context for the base model."""
    return tuple(MODES) if w[1] else ("contexts",)


def run(args: argparse.Namespace, py: Path) -> dict[str, Any]:
    from benchmarks.decode_paths import (BATCH, PROMPT, QUICK_SHAPE, RANK, SHAPE, RawDecode, adapter_names,
                                         agreement, loaded_event, row_adapters, write_assets)
    from benchmarks.harness import Timing
    from computed.model.loader import load_model
    from computed.model.runner import Runner
    from computed.residency.pool import MemoryPool, PoolSpec
    from computed.residency.blob_cache import slot_weights
    from statesvc.tools.example import write_model

    shape = QUICK_SHAPE if args.quick else SHAPE
    threads = args.threads or os.cpu_count() or 1
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, shape.vocab_size, (BATCH, PROMPT)).astype(np.int32)  # bench_decode's
    names = adapter_names()[:ADAPTER_MIX]
    started, load_before = time.perf_counter(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-peer-") as tmp_s:
        tmp = Path(tmp_s)
        print("writing the checkpoints and adapters, converting them to GGUF ...", flush=True)
        model_dir, dirs = write_assets(tmp, shape)
        bf16_dir = write_model(tmp / "model-bf16", shape, seed=0, dtype="bfloat16")
        t0 = time.perf_counter()
        gguf = {"f32": tmp / "model-f32.gguf", "bf16": tmp / "model-bf16.gguf"}
        convert(py, "model", str(model_dir), str(gguf["f32"]), "--type", "f32")
        convert(py, "model", str(bf16_dir), str(gguf["bf16"]), "--type", "bf16")
        lora = {n: tmp / f"{n}.gguf" for n in names}
        for n in names:
            convert(py, "adapter", str(dirs[n]), str(model_dir), str(lora[n]))
        convert_s = time.perf_counter() - t0

        peer = Peer(py, tmp / "worker.log")
        try:
            info = peer.call(op="info")
            for dtype, k in WORKLOADS:
                groups: list[list[Any]]
                if k == 0:
                    groups = [[list(range(BATCH)), None]]
                else:
                    groups = [[[r for r in range(BATCH) if r % k == a], str(lora[names[a]])] for a in range(k)]
                for mode in modes((dtype, k)):
                    peer.call(op="setup", key=f"{dtype}-{k}-{mode}", model=str(gguf[dtype]), mode=mode,
                              prompts=prompts.tolist(), groups=groups, threads=threads)
            ours: dict[tuple[str, int], Any] = {}
            for dtype, src in (("f32", model_dir), ("bf16", bf16_dir)):
                config, params = load_model(src, "float32" if dtype == "f32" else "bfloat16")
                pool = MemoryPool(PoolSpec(num_layers=config.num_layers, module_dims=config.module_dims,
                                           slots=len(names) + 1, max_rank=RANK, dtype="float32"))
                for slot, name in enumerate(names):
                    data = (dirs[name] / "adapter_model.safetensors").read_bytes()
                    pool.write_slot(slot, slot_weights(data, loaded_event(name, slot, data)))
                runner = Runner(config, params, max_batch=BATCH, max_len=PROMPT + args.steps + 8)
                runner.warmup(pool.arrays, runner.new_cache())
                for d, k in WORKLOADS:
                    if d == dtype:
                        ours[d, k] = RawDecode(runner, pool, prompts, np.asarray(row_adapters(k)))
            timings = {w: Timing() for w in WORKLOADS}
            peer_s: dict[tuple[str, int, str], list[float]] = {(*w, m): [] for w in WORKLOADS for m in modes(w)}
            peer_tokens: dict[tuple[str, int, str], list[list[int]]] = {}
            for r in range(args.repeats + 1):
                for w in WORKLOADS:
                    ours[w].round(args.steps, timings[w] if r else None)
                    for m in modes(w):
                        got = peer.call(op="round", key=f"{w[0]}-{w[1]}-{m}", steps=args.steps)
                        peer_tokens[(*w, m)] = got["tokens"]
                        if r:
                            peer_s[(*w, m)].append(got["seconds"])
                print(f"round {r}: " + ", ".join(
                    f"{d} k={k} ours {BATCH * args.steps / timings[d, k].seconds[-1]:.0f} llama.cpp " + "/".join(
                        f"{m} {BATCH * args.steps / peer_s[d, k, m][-1]:.0f}" for m in modes((d, k)))
                    for d, k in WORKLOADS if r), flush=True)
        finally:
            peer.stop()
    steps = args.steps
    cells: dict[str, Any] = {}
    fastest: dict[tuple[str, int], str] = {}
    for w in WORKLOADS:
        o = [BATCH * steps / s for s in timings[w].seconds]
        per_mode = {m: [BATCH * steps / s for s in peer_s[(*w, m)]] for m in modes(w)}
        fastest[w] = max(per_mode, key=lambda m: median(per_mode[m]))
        p = per_mode[fastest[w]]
        ratios = [a / b for a, b in zip(o, p)]
        ours_tokens = [list(t) for t in ours[w].tokens]
        cells[f"{w[0]}-{w[1]}"] = {
            "dtype": w[0], "adapters": w[1], "ours": {"tokens_per_s": median(o), "spread": spread(o)},
            "llamacpp": {"tokens_per_s": median(p), "spread": spread(p)},
            "ours_over_llamacpp": median(ratios), "ours_over_llamacpp_spread": spread(ratios),
            "token_agreement": agreement(ours_tokens, peer_tokens[(*w, fastest[w])]),
            "others_share": timings[w].others_share}
        if w[1]:
            cells[f"{w[0]}-{w[1]}"]["adapter_mode"] = fastest[w]
            cells[f"{w[0]}-{w[1]}"]["llamacpp_modes"] = {
                m: {"tokens_per_s": median(t), "spread": spread(t), "describes": MODES[m],
                    "ours_over_it": median([a / b for a, b in zip(o, t)]),
                    "token_agreement": agreement(ours_tokens, peer_tokens[(*w, m)])} for m, t in per_mode.items()}
    mix = ("f32", ADAPTER_MIX)
    base, mixed = peer_s["f32", 0, "contexts"], peer_s[(*mix, fastest[mix])]
    own = [b / m for b, m in zip(base, mixed)]  # tokens/s ratio: adapters over base = base s / adapters s
    build_info = peer_dir() / "build-info.json"
    return {"machine": machine_info(), "peer": "built", "model": {"shape": shape.__dict__},
            "peer_build": json.loads(build_info.read_text()) if build_info.is_file() else {},
            "peer_system_info": info.get("system_info", ""),
            "settings": {"steps": steps, "repeats": args.repeats, "threads": threads, "batch": BATCH,
                         "prompt": PROMPT, "adapters": ADAPTER_MIX,
                         "adapter_mode": f"{fastest[mix]}: {MODES[fastest[mix]]} (llama.cpp's faster mode here)"},
            "workloads": cells,
            "llamacpp_adapters_over_base": median(own), "llamacpp_adapters_over_base_spread": spread(own),
            "convert_seconds": round(convert_s, 1), "seconds": round(time.perf_counter() - started, 1),
            "load_average": {"before": list(load_before), "after": list(os.getloadavg())}}


LABELS = {"f32-0": "base model, float32 (GGUF f32)", "bf16-0": "base model, bfloat16 (GGUF bf16)",
          f"f32-{ADAPTER_MIX}": f"{ADAPTER_MIX} distinct adapters, float32"}


def targets(r: dict[str, Any]) -> dict[str, float]:
    return {"f32-0": TARGET_BASE, "bf16-0": TARGET_BASE, f"f32-{ADAPTER_MIX}": TARGET_ADAPTERS}


def report(r: dict[str, Any]) -> str:
    """The bench:peer section (docs/results-detail.md)."""
    if r.get("peer") != "built":
        return f"llama.cpp peer: {r.get('peer')} ({r.get('why', '')}); no figures in this run."
    m, s = r["machine"], r["settings"]
    lines = ["| batch of 32 | ours tokens/s | llama.cpp tokens/s | ours / llama.cpp (spread) | target "
             "| tokens agree |", "|---|---:|---:|---:|---|---:|"]
    for key, cell in r["workloads"].items():
        goal = targets(r)[key]
        lo, hi = cell["ours_over_llamacpp_spread"]
        verdict = "PASS" if cell["ours_over_llamacpp"] >= goal else "MISS"
        lines.append(f"| {LABELS[key]} | {cell['ours']['tokens_per_s']:,.0f} | {cell['llamacpp']['tokens_per_s']:,.0f} "
                     f"| {cell['ours_over_llamacpp']:.2f}x ({lo:.2f}-{hi:.2f}) | >= {goal:g}x: {verdict} "
                     f"| {cell['token_agreement']:.0%} |")
    for key, cell in r["workloads"].items():
        if "llamacpp_modes" in cell:
            lines += ["", f"llama.cpp's modes for {LABELS[key]} (the table uses `{cell['adapter_mode']}`): " + "; ".join(
                f"`{m}` ({v['describes']}) {v['tokens_per_s']:,.0f} tokens/s, ours / it {v['ours_over_it']:.2f}x, "
                f"tokens agree {v['token_agreement']:.0%}" for m, v in cell["llamacpp_modes"].items())]
    la = r["load_average"]
    others = max(x for cell in r["workloads"].values() for x in cell["others_share"])
    lo, hi = r["llamacpp_adapters_over_base_spread"]
    lines += ["", f"llama.cpp's {s['adapters']} adapters / its own base model: {r['llamacpp_adapters_over_base']:.2f}x "
              f"({lo:.2f}-{hi:.2f}); {s['adapter_mode']}. llama-cpp-python "
              f"{r['peer_build'].get('llama_cpp_python', '?')} built with `{r['peer_build'].get('cmake_args', '?')}`; "
              f"{s['threads']} threads each; {s['repeats']} rounds of {s['steps']} steps, medians; on {m['cpu']}, "
              f"{m['nproc']} CPUs, our kernels built for {', '.join(m['kernel_isas'] or ['?'])}; load average "
              f"{la['before'][0]:.1f} before, {la['after'][0]:.1f} after (this run's own threads count in it); "
              f"other processes used at most {others:.0%} of the CPUs in our rounds"
              + (": the run was disturbed (ratios pair one round's figures, but llama.cpp's OpenMP barriers "
                 "suffer more from shared cores than our kernels do)." if others > CONTENDED else ": undisturbed.")]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--steps", type=int, default=16, help="greedy steps per timed round")
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds (after one warm-up round)")
    ap.add_argument("--threads", type=int, default=0, help="llama.cpp threads (default: the CPU count)")
    peer_output_flags(ap, "peer", "a tiny model, for a smoke run; never builds the peer")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.steps = 1, 4
    venv = peer_dir()
    py = peer_python(venv)
    result: dict[str, Any]
    if py is None and args.quick:
        result = {"machine": machine_info(), "peer": "not built", "why": f"no llama-cpp-python in {venv}"}
    elif py is None and (built := build_peer(venv))[0] is None:
        result = {"machine": machine_info(), "peer": "build failed", "why": built[1]}
    else:
        result = run(args, py or venv / "bin" / "python")
    return publish_peer("peer", result, report(result), args)


def figures(r: dict[str, Any]) -> list[Figure]:
    """Ours over llama.cpp on the same batches (issue 20); none when the peer was not built."""
    if r.get("peer") != "built":
        return []
    runs = r["settings"]["repeats"]
    out = []
    for key, cell in r["workloads"].items():
        k, dtype = cell["adapters"], "bfloat16" if cell["dtype"] == "bf16" else "float32"
        mix = "base model" if k == 0 else f"{k} distinct adapters"
        goal = 1.0 if k == 0 else 3.0
        if k == 0 and dtype == "float32":
            out.append(figure("peer", "llama.cpp decode, base model, batch 32", cell["llamacpp"]["tokens_per_s"],
                              "tokens/s", spread=cell["llamacpp"]["spread"], runs=runs))
        out.append(figure("peer", f"decode, {mix}, {dtype}: ours / llama.cpp", cell["ours_over_llamacpp"], "x",
                          target=f">= {goal:g}x", meets=cell["ours_over_llamacpp"] >= goal,
                          spread=cell["ours_over_llamacpp_spread"], runs=runs))
    out.append(figure("peer", "llama.cpp decode, 16 distinct adapters / its base model",
                      r["llamacpp_adapters_over_base"], "x", spread=r["llamacpp_adapters_over_base_spread"], runs=runs))
    return out


if __name__ == "__main__":
    raise SystemExit(main())
