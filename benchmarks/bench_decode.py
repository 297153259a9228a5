"""Decode throughput of 32 sequences on 0, 1, 4, 16 and 32 distinct adapters: ours against PEFT.

    .venv/bin/python -m benchmarks.bench_decode [--steps 8] [--repeats 5] [--no-write] [--quick]

Its paths are in benchmarks/decode_paths.py (ours, the engine's, the served replica) and
benchmarks/decode_peft.py (PEFT's), its results section in benchmarks/decode_report.py.
What it runs, and why: docs/benchmarks.md, "bench_decode.py".
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from rich.console import Console

from benchmarks.decode_paths import (ADAPTERS, ALPHA, ALTERNATIVES, BATCH, LABELS, LOOP, MIXES, PATHS, PEFT_WHOLE_MIXES,
                                     PROMPT, QUICK_SHAPE, RANK, SERVED, SERVED_TOKENS, SHAPE, TARGET_MIX,
                                     TARGET_OVER_BASE, TARGET_OVER_PEFT, TARGET_SERVED_OVER_ENGINE, WHOLE,
                                     DeepDecode, EngineDecode, EngineRequests, RawDecode,
                                     RequestTiming, ServedReplica, Serving, adapter_names, agreement,
                                     alternative_runners, loaded_event, row_adapters, served_max_batch,
                                     write_assets)
from benchmarks.decode_peft import PeftProcess, gemm_rate_kernel, gemm_rate_xla
from benchmarks.decode_report import _mix_label, adapter_fraction, render
from benchmarks.harness.stats import CONTENDED
from benchmarks.harness import (Figure, Timing, clean_rounds, decode_rates, figure, machine_info, median,
                                output_flags, paired, publish, spread)
from computed.model.loader import load_model
from computed.model.runner import Runner
from computed.residency.blob_cache import slot_weights
from computed.residency.pool import MemoryPool, PoolSpec
from shared.config import POOL_DTYPES
from shared.projections import MODULES
from shared.reducer import State
from testkit.jaxcount import counting_compiles

os.environ.setdefault("HF_HUB_OFFLINE", "1")

console = Console() if sys.stdout.isatty() else Console(width=150)


def run(args: argparse.Namespace) -> dict[str, Any]:
    MIXES = args.mixes  # noqa: N806 (the module's name for them)
    steps, repeats, max_len = args.steps, args.repeats, args.max_len
    max_rounds = max(repeats, args.max_rounds or 2 * repeats)
    # the prefill's token, the admitting step, every round, and one more: nothing finishes while timed
    max_new = 3 + (max_rounds + 1) * steps
    if PROMPT + max_new > max_len:
        raise SystemExit(f"--max-len {max_len} is too short for {max_rounds + 1} rounds of {steps} steps "
                         f"after a {PROMPT}-token prompt; raise --max-len or lower --steps/--max-rounds")
    shape = QUICK_SHAPE if args.quick else SHAPE
    started = time.perf_counter()
    load_before = os.getloadavg()
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, shape.vocab_size, (BATCH, PROMPT)).astype(np.int32)
    with tempfile.TemporaryDirectory(prefix="bench-decode-") as tmp:
        console.print("writing the checkpoint and adapters ...")
        model_dir, dirs = write_assets(Path(tmp), shape)
        console.print(f"loading transformers + PEFT in a process of its own ({args.torch_threads} torch "
                      "threads) ...")
        peft_proc = PeftProcess(model_dir, dirs, args.torch_threads, prompts, MIXES)
        served_proc: ServedReplica | None = None
        try:
            if PROMPT + args.served_tokens > max_len:
                raise SystemExit(f"--max-len {max_len} is too short for {args.served_tokens} served tokens")
            console.print(f"starting statesvc and `computed serve` ({args.served_clients} clients, "
                          f"{args.served_tokens} new tokens each) ...")
            served_proc = ServedReplica(Path(tmp), model_dir, dirs, prompts, clients=args.served_clients,
                                   new_tokens=args.served_tokens, max_len=max_len, slots=args.slots,
                                   pool_dtype=args.pool_dtype, max_batch=args.served_max_batch,
                                   warm=not args.quick)
            replica = served_proc
            config, params = load_model(model_dir)
            # which backend the "decode" column ran on, as serving selects it here
            backend_info = {"name": type(params.backend).__name__,
                            **dataclasses.asdict(params.backend)}
            pool = MemoryPool(PoolSpec(num_layers=config.num_layers, module_dims=config.module_dims,
                                       slots=args.slots, max_rank=RANK, dtype=args.pool_dtype))
            adapters = {}
            for slot, name in enumerate(adapter_names()):
                data = (dirs[name] / "adapter_model.safetensors").read_bytes()
                adapters[name] = loaded_event(name, slot, data)
                pool.write_slot(slot, slot_weights(data, adapters[name]))
            serving = Serving(pool, State(seq=ADAPTERS + 1, adapters=adapters))
            runner = Runner(config, params, max_batch=BATCH, max_len=max_len)
            others = alternative_runners(runner)
            n_params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(others[LOOP].params))

            console.print("prefilling (this compiles prefill and decode) ...")
            raw = {k: RawDecode(runner, pool, prompts, np.asarray(row_adapters(k))) for k in MIXES}
            alternatives = {a: {k: RawDecode(others[a], pool, prompts, np.asarray(row_adapters(k)))
                                for k in MIXES if k or a == LOOP} for a in ALTERNATIVES}
            # a smoke run skips the engines' warm-up (every prefill and decode shape of a 32-row
            # batch): its warm-up round compiles the few it runs, before anything is timed
            warm = not args.quick
            engines = {k: EngineDecode(runner, serving, prompts, row_adapters(k), max_new, warm=warm)
                       for k in MIXES}
            no_pool = RawDecode(runner, None, prompts, np.full(BATCH, -1))
            timings = {p: {k: Timing() for k in MIXES} for p in PATHS}
            for a, by_mix in alternatives.items():
                timings[a] = {k: Timing() for k in by_mix}
            no_pool_timing = Timing()
            # the served path's work three ways, timed whole: served, in process, PEFT
            requests = EngineRequests(runner, serving, prompts, clients=args.served_clients,
                                      new_tokens=args.served_tokens, warm=warm)
            whole = {w: {k: RequestTiming() for k in (PEFT_WHOLE_MIXES if w == "peft" else MIXES)}
                     for w in WHOLE}
            whole_tokens: dict[str, dict[int, list[list[int]]]] = {w: {} for w in WHOLE}

            def one_round(k: int, count: bool) -> None:
                if k == 0:
                    no_pool.round(steps, no_pool_timing if count else None)
                raw[k].round(steps, timings["decode"][k] if count else None)
                for a, by_mix in alternatives.items():
                    if k in by_mix:
                        by_mix[k].round(steps, timings[a][k] if count else None)
                engines[k].round(steps, timings["engine"][k] if count else None)
                peft_proc.round(k, steps, timings["peft"][k] if count else None)
                replica.round(k, whole[SERVED][k] if count else None)
                whole_tokens[SERVED][k] = replica.outputs
                requests.round(k, whole["engine"][k] if count else None)
                whole_tokens["engine"][k] = requests.outputs
                if k in whole["peft"]:
                    whole_tokens["peft"][k] = peft_proc.requests(k, args.served_clients, args.served_tokens,
                                                                 whole["peft"][k] if count else None)

            console.print("round 0 (warm-up)")
            for k in MIXES:
                one_round(k, False)
            every = [no_pool_timing, *(t for by_mix in timings.values() for t in by_mix.values()),
                     *(t for by_mix in whole.values() for t in by_mix.values())]
            rounds, clean = 0, []
            with counting_compiles() as compiles:
                while len(clean) < repeats and rounds < max_rounds:  # rounds other processes disturbed don't count
                    for k in MIXES:
                        one_round(k, True)
                    rounds += 1
                    clean = clean_rounds(every, rounds)
                    console.print(f"round {rounds}: {len(clean)} of {repeats} without other load")
            for t in every:
                t.used = clean or None
            tokens_agree = {}
            for k in MIXES:
                ours = raw[k].tokens
                served = engines[k].outputs()
                engine = [np.array([out[1 + i] for out in served]) for i in range(steps)]
                tokens_agree[str(k)] = {"decode_vs_peft": agreement(ours, peft_proc.tokens[k]),
                                        "decode_vs_engine": agreement(ours, engine),
                                        "served_vs_engine": agreement(whole_tokens[SERVED][k],
                                                                      whole_tokens["engine"][k]),
                                        **({"served_vs_peft": agreement(whole_tokens[SERVED][k],
                                                                        whole_tokens["peft"][k])}
                                           if k in whole_tokens["peft"] else {})}
                for a, by_mix in alternatives.items():
                    if k in by_mix:
                        tokens_agree[str(k)][f"decode_vs_{a}"] = agreement(ours, by_mix[k].tokens)
            del raw, alternatives, engines, no_pool, others, requests
            iters = 2 if args.quick else 50  # a smoke run: each rate's code runs, on the full product
            gemm = {"xla": gemm_rate_xla(iters), "kernel": gemm_rate_kernel(iters),
                    "torch": peft_proc.gemm_rate(iters)}
        finally:
            peft_proc.stop()
            if served_proc is not None:
                served_proc.stop()

        long_base = long_context = None
        if args.long_max_len:
            console.print(f"base batch with a {args.long_max_len}-position cache ...")
            long_runner = Runner(config, params, max_batch=BATCH, max_len=args.long_max_len)
            long = RawDecode(long_runner, pool, prompts, np.full(BATCH, -1))
            long.round(steps, None)
            t = Timing()
            while (len(clean_rounds([t], len(t.seconds))) < args.long_repeats
                   and len(t.seconds) < 3 * args.long_repeats):
                long.round(steps, t)
            t.used = clean_rounds([t], len(t.seconds)) or None
            long_base = {"max_len": args.long_max_len, **t.as_dict(steps)}
            del long
            deep = {a: DeepDecode(long_runner, 3 * args.long_max_len // 4, a) for a in ("kernel", "xla")}
            console.print(f"base batch from position {3 * args.long_max_len // 4} of that cache, "
                          "attention by the kernel and by XLA ...")
            deep_t = {a: Timing() for a in deep}
            for d in deep.values():
                d.round(steps, None)  # compiles
            while (len(clean_rounds(list(deep_t.values()), len(deep_t["kernel"].seconds))) < args.long_repeats
                   and len(deep_t["kernel"].seconds) < 3 * args.long_repeats):
                for a, d in deep.items():
                    d.round(steps, deep_t[a])
            used = clean_rounds(list(deep_t.values()), len(deep_t["kernel"].seconds)) or None
            for t in deep_t.values():
                t.used = used
            per_round = [deep_t["xla"].seconds[i] / deep_t["kernel"].seconds[i] for i in deep_t["kernel"].rounds()]
            long_context = {"max_len": args.long_max_len, "start": 3 * args.long_max_len // 4,
                            **{a: t.as_dict(steps) for a, t in deep_t.items()},
                            "kernel_over_xla": median(per_round), "kernel_over_xla_spread": spread(per_round)}
            del deep

    table = {}
    for k in MIXES:
        row: dict[str, Any] = {p: timings[p][k].as_dict(steps) for p in (*PATHS, *ALTERNATIVES)
                               if k in timings[p]}
        versus = {"base": lambda p: timings[p][0], "peft": lambda p: timings["peft"][k]}
        for a in ALTERNATIVES:
            if k in timings[a]:
                versus[a] = lambda p, a=a: timings[a][k]  # type: ignore[misc]
        for p in ("decode", "engine"):
            for name, other in versus.items():
                row[p][f"over_{name}"], row[p][f"over_{name}_spread"] = paired(timings[p][k], other(p))
        for a in ALTERNATIVES:
            if k in timings[a]:
                for name, other in (("base", timings["decode"][0]), ("peft", timings["peft"][k])):
                    row[a][f"over_{name}"], row[a][f"over_{name}_spread"] = paired(timings[a][k], other)
        table[str(k)] = row
    served_table: dict[str, Any] = {}
    for k in MIXES:
        cell = whole[SERVED][k].as_dict()
        cell.update({w: whole[w][k].as_dict() for w in WHOLE if w != SERVED and k in whole[w]})
        for name, against in (("base", whole[SERVED][0]), ("peft", whole["peft"].get(k)),
                              ("engine", whole["engine"][k])):
            if against is None:
                continue
            per_round = [whole[SERVED][k].rate(i) / against.rate(i) for i in whole[SERVED][k].rounds()]
            cell[f"over_{name}"], cell[f"over_{name}_spread"] = median(per_round), spread(per_round)
        served_table[str(k)] = cell
    targets = []
    for p in ("decode", "engine"):
        top = table[str(TARGET_MIX)][p]
        targets += [
            {"name": f"{LABELS[p]}: {TARGET_MIX} adapters / base model", "measured": round(top["over_base"], 3),
             "target": f">= {TARGET_OVER_BASE}x", "met": top["over_base"] >= TARGET_OVER_BASE},
            {"name": f"{LABELS[p]}: {TARGET_MIX} adapters / PEFT, same batch", "measured": round(top["over_peft"], 3),
             "target": f">= {TARGET_OVER_PEFT}x", "met": top["over_peft"] >= TARGET_OVER_PEFT}]
    top = served_table[str(TARGET_MIX)]
    targets += [
        {"name": f"served: {TARGET_MIX} adapters / base model", "measured": round(top["over_base"], 3),
         "target": f">= {TARGET_OVER_BASE}x", "met": top["over_base"] >= TARGET_OVER_BASE},
        {"name": f"served: {TARGET_MIX} adapters / PEFT, same batch", "measured": round(top["over_peft"], 3),
         "target": f">= {TARGET_OVER_PEFT}x", "met": top["over_peft"] >= TARGET_OVER_PEFT},
        {"name": f"served / in-process Engine.step (the same requests), {TARGET_MIX} adapters", "measured": round(top["over_engine"], 3),
         "target": f">= {TARGET_SERVED_OVER_ENGINE}x", "met": top["over_engine"] >= TARGET_SERVED_OVER_ENGINE}]
    info = peft_proc.info
    return {
        "machine": machine_info(), "backend": backend_info, "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "versions": {"jax": jax.__version__, "torch": info["torch"], "transformers": info["transformers"],
                     "peft": info["peft"]},
        "model": {**{k: v for k, v in vars(shape).items() if k != "rope_scaling"}, "parameters": n_params,
                  "dtype": "float32", "attn_implementation": info["attn_implementation"]},
        "adapters": {"count": ADAPTERS, "rank": RANK, "alpha": ALPHA, "targets": list(MODULES),
                     "fraction_of_projections": adapter_fraction(shape, TARGET_MIX)},
        "settings": {"batch": BATCH, "prompt": PROMPT, "steps": steps, "repeats": repeats,
                     "rounds_run": rounds, "clean_rounds": clean, "contended_above": CONTENDED,
                     "slots": args.slots, "pool_dtype": args.pool_dtype, "max_len": max_len,
                     "torch_threads": args.torch_threads, "quick": args.quick,
                     "served_clients": args.served_clients, "served_tokens": args.served_tokens,
                     "served_max_batch": args.served_max_batch,
                     "xla_threads": os.cpu_count()},
        "results": table, "served": served_table, "targets": targets, "compiles_while_timing": len(compiles),
        "no_pool_base": no_pool_timing.as_dict(steps),
        "tokens_agree": tokens_agree, "long_cache_base": long_base,
        "long_context": long_context, "gemm_gflops": gemm,
        "seconds": round(time.perf_counter() - started, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--steps", type=int, default=8, help="decode steps per timed round")
    ap.add_argument("--repeats", type=int, default=5,
                    help="timed rounds without other load wanted (after one warm-up round)")
    ap.add_argument("--max-rounds", type=int, default=0,
                    help="give up waiting for undisturbed rounds after this many (default: 2 x --repeats)")
    ap.add_argument("--max-len", type=int, default=256, help="KV-cache positions per row (ours)")
    ap.add_argument("--slots", type=int, default=64, help=f"pool slots (max_loras); {ADAPTERS} are filled")
    ap.add_argument("--pool-dtype", choices=POOL_DTYPES, default="float32",
                    help="the pool's dtype (`loractl pool init --dtype`); the model is float32")
    ap.add_argument("--torch-threads", type=int, default=os.cpu_count() or 1,
                    help="torch.set_num_threads for PEFT (XLA uses every core)")
    ap.add_argument("--long-max-len", type=int, default=1024,
                    help="time the base batch again with a cache this long (0: skip)")
    ap.add_argument("--long-repeats", type=int, default=3,
                    help="undisturbed rounds wanted for each long-cache figure")
    ap.add_argument("--served-clients", type=int, default=BATCH,
                    help="concurrent clients (one DEALER each) of the served replica (`--max-batch` is 32)")
    ap.add_argument("--served-tokens", type=int, default=SERVED_TOKENS,
                    help="new tokens each served request generates")
    ap.add_argument("--mixes", default=",".join(map(str, MIXES)),
                    help=f"distinct adapters per batch to time, comma-separated (the targets need 0 and "
                         f"{TARGET_MIX}); fewer for a shorter run, with --no-write")
    output_flags(ap, "decode", "a smoke run: a tiny model, one round of 4 steps, mixes 0 and 16, no long "
                 "cache; writes nothing unless `python -m benchmarks --quick` points it elsewhere")
    args = ap.parse_args(argv)
    mixes = tuple(sorted({int(k) for k in args.mixes.split(",")}))
    if not {0, TARGET_MIX} <= set(mixes) <= set(MIXES):
        ap.error(f"--mixes must include 0 and {TARGET_MIX} (the targets') and be among {MIXES}; got {args.mixes!r}")
    if mixes != MIXES and not args.no_write:
        ap.error("--mixes other than all of them needs --no-write (results/ keeps every mix)")
    if args.quick:  # the base model and the targets' mix: every path and figure kind, 2 of 5 mixes' compiles
        args.steps, args.repeats, args.max_rounds, args.max_len, args.long_max_len = 4, 1, 1, 64, 0
        args.served_clients, args.served_tokens = 4, 4
        # one torch thread: with two, PEFT's process spun ~10x the CPU its few steps need
        args.torch_threads = 1
        mixes = (0, TARGET_MIX)
    args.served_max_batch = served_max_batch(args.quick, args.served_clients)
    args.mixes = mixes
    if not 1 <= args.served_clients <= BATCH:
        ap.error(f"--served-clients must be in [1, {BATCH}] (the batch, the replica's --max-batch)")
    if args.slots < ADAPTERS:
        ap.error(f"--slots must be at least {ADAPTERS}, the adapters the batch mixes")
    result = run(args)
    markdown = render(result)
    console.print(markdown)
    console.print("whole requests, tokens/s served / in process / PEFT: " + ", ".join(
        f"{_mix_label(k)} {c['tokens_per_s']:,.0f} / {c['engine']['tokens_per_s']:,.0f} / "
        + (f"{c['peft']['tokens_per_s']:,.0f} " if "peft" in c else "- ")
        + f"({c['over_engine']:.2f}x in process" + (f", {c['over_peft']:.2f}x PEFT)" if "peft" in c else ")")
        for k in mixes for c in (result["served"][str(k)],)))
    publish("decode", result, markdown, quick=args.quick, no_write=args.no_write, say=console.print)
    return 0


def figures(r: dict[str, Any]) -> list[Figure]:
    """The benchmark's own ratios (medians of per-round ratios, with their spread), so the
    table and the benchmark's section agree."""
    results = r["results"]
    steps, batch = r["settings"]["steps"], r["settings"]["batch"]
    base = decode_rates(results["0"]["decode"], batch * steps)
    out = [figure("decode", "decode, base model, batch 32", median(base), "tokens/s",
                  spread=spread(base), runs=len(base))]
    if "over_loop" in results["0"]["decode"]:  # the dense kernel and attention alone: no LoRA terms
        out.append(figure("decode", "decode, base model: ours / XLA only (no native kernels)",
                          results["0"]["decode"]["over_loop"], "x",
                          spread=results["0"]["decode"].get("over_loop_spread"), runs=len(base)))
    for k in sorted(results, key=int):
        if k == "0":
            continue
        ours = results[k]["decode"]
        runs = len(decode_rates(ours, batch * steps))
        label = f"{k} distinct adapter{'s' if k != '1' else ''}"
        for key, name, goal in (("base", "/ base model", 0.75),
                                ("peft", ": ours / PEFT mixed batch", 3.0),
                                ("loop", ": ours / XLA only (no native kernels)", None),
                                ("gather", ": ours / per-token gather (BGMV-style)", None)):
            if f"over_{key}" not in ours:
                continue
            value = ours[f"over_{key}"]
            target = f">= {goal:g}x" if goal is not None and k == "16" else None
            out.append(figure("decode", f"decode, {label} {name}".replace(" :", ":"), value, "x",
                              target=target, meets=value >= goal if target and goal else None,
                              spread=ours.get(f"over_{key}_spread"), runs=runs))
    served = r.get("served") or {}
    for k in sorted(served, key=int):
        cell = served[k]
        runs = len(cell["seconds"]) if cell.get("used_rounds") is None else len(cell["used_rounds"])
        label = "base model" if k == "0" else f"{k} distinct adapter{'s' if k != '1' else ''}"
        if k == "0":
            out.append(figure("decode", "served, base model, batch 32", cell["tokens_per_s"], "tokens/s",
                              spread=cell["tokens_per_s_spread"], runs=runs))
        for key, name, goal in (("base", "/ served base", 0.75), ("peft", "/ PEFT mixed batch", 3.0),
                                ("engine", "/ in-process Engine.step, the same requests", 0.9)):
            if k == "0" and key == "base" or f"over_{key}" not in cell:
                continue
            value = cell[f"over_{key}"]
            target = f">= {goal:g}x" if k == "16" else None
            out.append(figure("decode", f"served, {label} {name}", value, "x", target=target,
                              meets=value >= goal if target else None,
                              spread=cell.get(f"over_{key}_spread"), runs=runs))
    lc = r.get("long_context")
    if lc:
        out.append(figure("decode", f"decode, base model from position {lc['start']} of {lc['max_len']}: "
                          "attention kernel / XLA attention", lc["kernel_over_xla"], "x",
                          spread=lc["kernel_over_xla_spread"], runs=len(lc["kernel"]["seconds"])))
    return out


if __name__ == "__main__":
    sys.exit(main())
