"""Decode throughput per model family: 16 distinct adapters against the base model, and against PEFT.

    .venv/bin/python -m benchmarks.bench_families [--steps 8] [--repeats 5] [--families llama,qwen2]
        [--no-write] [--quick]

What it runs, and why: docs/benchmarks.md, "bench_families.py".
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
from rich.console import Console

from benchmarks.decode_paths import (ALPHA, BATCH, PROMPT, QUICK_SHAPE, RANK, SHAPE, TARGET_MIX, RawDecode,
                                     adapter_names, agreement, loaded_event, row_adapters)
from benchmarks.decode_peft import PeftProcess
from benchmarks.harness import (Figure, Timing, clean_rounds, decode_rates, figure, machine_info, median,
                                output_flags, publish, spread, target_lines)
from benchmarks.harness.stats import CONTENDED
from computed.model.loader import load_model
from computed.model.runner import Runner
from computed.residency.pool import MemoryPool, PoolSpec
from computed.residency.blob_cache import slot_weights
from shared.projections import ATTN_MODULES, MODULES
from statesvc.tools.example import AdapterSpec, ModelShape, make_example
from testkit.jaxcount import counting_compiles

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@dataclass(frozen=True)
class FamilyBench:
    """One family's row of the benchmark: its `model_type` (statesvc/tools/families.py), the
    modules its adapters target (a mixture-of-experts family takes LoRA on attention only), and
    its shape where it is not the decode benchmark's (a MoE family's experts)."""

    family: str
    targets: tuple[str, ...] = MODULES
    shape: ModelShape | None = None
    quick_shape: ModelShape | None = None


# one entry per family; a new family is a new line
FAMILIES: tuple[FamilyBench, ...] = (
    FamilyBench("llama"),
    FamilyBench("qwen2"),
    FamilyBench("qwen3"),
    FamilyBench("mistral"),
    FamilyBench("gemma2"),
    FamilyBench("gemma3_text"),
    FamilyBench("olmo2"),
    FamilyBench("granite"),
    # mixtures of experts (the example's 4 experts, 2 a token): LoRA on attention only
    FamilyBench("mixtral", targets=ATTN_MODULES),
    FamilyBench("qwen3_moe", targets=ATTN_MODULES),
)
REFERENCE = "llama"  # the family every other one's 16 adapters / base is compared with
QUICK_FAMILIES = (REFERENCE, "gemma2")  # a smoke run: Llama and the family furthest from it
ADAPTERS = TARGET_MIX  # 16: row i of the adapter batch on adapter i % 16, two rows each
MIXES = (0, ADAPTERS)
TARGET_OVER_REFERENCE = 0.9  # issue 38: each family's 16 adapters / base within 10% of Llama's

console = Console() if sys.stdout.isatty() else Console(width=150)


def ratio(a: Timing, b: Timing) -> tuple[float, list[float]]:
    """Throughput of a over b: the median and the spread of the per-round ratios (rounds both count)."""
    both = [i for i in a.rounds() if i in b.rounds()]
    per_round = [b.seconds[i] / a.seconds[i] for i in both]
    return median(per_round), spread(per_round)


class Ours:
    """Our decode of one family's checkpoint: its model loaded as serving loads it, the 16
    adapters in a pool, and the base batch and the 16-adapter batch prefilled (bench_decode's
    `RawDecode`)."""

    def __init__(self, bench: FamilyBench, root: Path, args: argparse.Namespace, prompts: np.ndarray) -> None:
        shape = (bench.quick_shape or QUICK_SHAPE) if args.quick else (bench.shape or SHAPE)
        self.names = adapter_names()[:ADAPTERS]
        specs = tuple(AdapterSpec(n, r=RANK, lora_alpha=ALPHA, target_modules=bench.targets) for n in self.names)
        console.print(f"[bold]{bench.family}[/bold]: writing the checkpoint and {ADAPTERS} adapters ...")
        self.assets = make_example(root / bench.family, family=bench.family, shape=shape, adapters=specs, seed=0)
        config, params = load_model(self.assets.model_dir)
        if config.model_type != bench.family:
            raise RuntimeError(f"make_example wrote a {config.model_type} checkpoint for {bench.family}")
        pool = MemoryPool(PoolSpec(num_layers=config.num_layers, module_dims=config.module_dims,
                                   slots=args.slots, max_rank=RANK, dtype="float32"))
        for slot, name in enumerate(self.names):
            data = (self.assets.adapter_dirs[name] / "adapter_model.safetensors").read_bytes()
            pool.write_slot(slot, slot_weights(data, loaded_event(name, slot, data, bench.targets)))
        runner = Runner(config, params, max_batch=BATCH, max_len=args.max_len)
        self.parameters = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params))
        self.backend = {"name": type(params.backend).__name__,
                        **dataclasses.asdict(params.backend)}  # type: ignore[call-overload]
        console.print(f"{bench.family}: prefilling (this compiles prefill and decode) ...")
        self.decode = {k: RawDecode(runner, pool, prompts, np.asarray(row_adapters(k))) for k in MIXES}

    def model(self) -> dict[str, Any]:
        return {**{k: v for k, v in vars(self.assets.shape).items() if k != "rope_scaling"},
                "parameters": self.parameters, "dtype": "float32"}


def run_family(bench: FamilyBench, root: Path, args: argparse.Namespace, prompts: np.ndarray,
               reference: Ours) -> dict[str, Any]:
    """One family: its checkpoint written; our decode of the base batch and the 16-adapter batch,
    Llama's same two (`reference`, loaded once for the whole run) and PEFT's of the family's
    16-adapter batch, rounds interleaved; the family's checkpoint deleted after."""
    started = time.perf_counter()
    own = bench.family == REFERENCE
    ours = reference if own else Ours(bench, root, args, prompts)
    peft_proc: PeftProcess | None = None
    try:
        peft_proc = PeftProcess(ours.assets.model_dir, ours.assets.adapter_dirs, args.torch_threads, prompts,
                                mixes=(ADAPTERS,))
        timings = {"base": Timing(), "adapters": Timing(), "peft": Timing()}
        if not own:  # Llama beside it in the same rounds: the ratio over Llama's pairs one round's
            timings.update({"reference_base": Timing(), "reference_adapters": Timing()})

        def one_round(count: bool) -> None:
            assert peft_proc is not None
            if not own:
                reference.decode[0].round(args.steps, timings["reference_base"] if count else None)
                reference.decode[ADAPTERS].round(args.steps, timings["reference_adapters"] if count else None)
            ours.decode[0].round(args.steps, timings["base"] if count else None)
            ours.decode[ADAPTERS].round(args.steps, timings["adapters"] if count else None)
            peft_proc.round(ADAPTERS, args.steps, timings["peft"] if count else None)

        one_round(False)  # warm-up
        rounds, clean = 0, list[int]()
        every = list(timings.values())
        with counting_compiles() as compiles:
            while len(clean) < args.repeats and rounds < args.max_rounds:
                one_round(True)
                rounds += 1
                clean = clean_rounds(every, rounds)
                console.print(f"{bench.family} round {rounds}: {len(clean)} of {args.repeats} without other load")
        for t in every:
            t.used = clean or None
        over_base, over_base_spread = ratio(timings["adapters"], timings["base"])
        over_peft, over_peft_spread = ratio(timings["adapters"], timings["peft"])
        result: dict[str, Any] = {
            "family": bench.family, "targets": list(bench.targets), "model": ours.model(), "backend": ours.backend,
            **{p: t.as_dict(args.steps) for p, t in timings.items()},
            "over_base": over_base, "over_base_spread": over_base_spread,
            "over_peft": over_peft, "over_peft_spread": over_peft_spread,
            "tokens_agree_with_peft": agreement(ours.decode[ADAPTERS].tokens, peft_proc.tokens[ADAPTERS]),
            "rounds_run": rounds, "clean_rounds": clean, "compiles_while_timing": len(compiles),
            "peft_versions": peft_proc.info,
        }
        if own:
            result["over_reference"], result["over_reference_spread"] = 1.0, [1.0, 1.0]
        else:  # (family 16 / base) / (Llama 16 / base), round by round
            secs = {p: t.seconds for p, t in timings.items()}
            per_round = [(secs["base"][i] / secs["adapters"][i])
                         / (secs["reference_base"][i] / secs["reference_adapters"][i])
                         for i in timings["base"].rounds()]
            result["over_reference"], result["over_reference_spread"] = median(per_round), spread(per_round)
            result["reference_over_base"], result["reference_over_base_spread"] = ratio(
                timings["reference_adapters"], timings["reference_base"])
    finally:
        if peft_proc is not None:
            peft_proc.stop()
        if not own:
            shutil.rmtree(ours.assets.root, ignore_errors=True)  # 444 MB a family at the full size
            del ours
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def run(args: argparse.Namespace, chosen: list[FamilyBench]) -> dict[str, Any]:
    started, load_before = time.perf_counter(), os.getloadavg()
    shape = QUICK_SHAPE if args.quick else SHAPE
    prompts = np.random.default_rng(0).integers(3, shape.vocab_size, (BATCH, PROMPT)).astype(np.int32)
    families: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-families-") as tmp:
        reference = Ours(next(f for f in FAMILIES if f.family == REFERENCE), Path(tmp), args, prompts)
        for bench in chosen:
            families[bench.family] = run_family(bench, Path(tmp), args, prompts, reference)
        del reference
    targets = [{"name": f"{name}: {ADAPTERS} adapters / base, over {REFERENCE}'s in the same rounds",
                "measured": round(r["over_reference"], 3), "target": f">= {TARGET_OVER_REFERENCE}x",
                "met": r["over_reference"] >= TARGET_OVER_REFERENCE}
               for name, r in families.items() if name != REFERENCE]
    info = families[REFERENCE]["peft_versions"]
    return {
        "machine": machine_info(), "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "versions": {"jax": jax.__version__, "torch": info["torch"], "transformers": info["transformers"],
                     "peft": info["peft"]},
        "adapters": {"count": ADAPTERS, "rank": RANK, "alpha": ALPHA},
        "settings": {"batch": BATCH, "prompt": PROMPT, "steps": args.steps, "repeats": args.repeats,
                     "max_rounds": args.max_rounds, "slots": args.slots, "max_len": args.max_len,
                     "torch_threads": args.torch_threads, "contended_above": CONTENDED, "quick": args.quick,
                     "xla_threads": os.cpu_count()},
        "reference": REFERENCE, "families": families, "targets": targets,
        "seconds": round(time.perf_counter() - started, 1),
    }


def _rate(cell: dict[str, Any]) -> str:
    lo, hi = cell["tokens_per_s_spread"]
    return f"{cell['tokens_per_s']:,.0f} ({lo:,.0f}-{hi:,.0f})"


def render(result: dict[str, Any]) -> str:
    s, ref = result["settings"], result["reference"]
    lines = [f"| family | parameters | base model tok/s | {ADAPTERS} adapters tok/s | PEFT, {ADAPTERS} adapters "
             f"tok/s | {ADAPTERS} adapters / base | ours / PEFT, {ADAPTERS} adapters | {ADAPTERS} / base over "
             f"{ref}'s (>= {TARGET_OVER_REFERENCE}x) | greedy tokens = PEFT's | undisturbed rounds |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in result["families"].items():
        b, o = r["over_base_spread"], r["over_peft_spread"]
        verdict = "-" if name == ref else ("PASS" if r["over_reference"] >= TARGET_OVER_REFERENCE else "MISS")
        lo, hi = r["over_reference_spread"]
        over_ref = "1.00 (itself)" if name == ref else f"{r['over_reference']:.2f} ({lo:.2f}-{hi:.2f}): {verdict}"
        clean = f"{len(r['clean_rounds'])} of {r['rounds_run']}"
        lines.append(f"| {name} | {r['model']['parameters'] / 1e6:.1f} M | {_rate(r['base'])} | "
                     f"{_rate(r['adapters'])} | {_rate(r['peft'])} | {r['over_base']:.2f} ({b[0]:.2f}-{b[1]:.2f}) "
                     f"| {r['over_peft']:.2f} ({o[0]:.2f}-{o[1]:.2f}) | {over_ref} "
                     f"| {100 * r['tokens_agree_with_peft']:.0f}% | {clean} |")
    first = result["families"][ref]
    m, v = first["model"], result["versions"]
    backends = sorted({r["backend"]["name"] for r in result["families"].values()})
    compiles = sum(r["compiles_while_timing"] for r in result["families"].values())
    mach = result["machine"]
    disturbed = [n for n, r in result["families"].items() if len(r["clean_rounds"]) < s["repeats"]]
    lines += ["",
              f"Each family's checkpoint (random, written by statesvc/tools/example.py with that family's "
              f"options, float32): vocab {m['vocab_size']}, hidden {m['hidden_size']}, intermediate "
              f"{m['intermediate_size']}, {m['num_hidden_layers']} layers, {m['num_attention_heads']} heads, "
              f"{m['num_key_value_heads']} KV heads, head_dim {m['head_dim']} (Gemma's embeddings tied, so "
              f"fewer parameters); {ADAPTERS} adapters, r={RANK}, alpha {ALPHA}, on every target module "
              "the family takes (`targets` in families.json: all seven for a dense family); a batch of "
              f"{s['batch']} rows, row i on adapter i % {ADAPTERS} (base: every row on the base model), "
              f"prompts of {s['prompt']} tokens, then {s['steps']} greedy steps a round. Ours: "
              "`Runner.decode` in a loop (bench_decode's `RawDecode`) on "
              f"{', '.join(backends)}; PEFT {v['peft']} mixed-batch inference (`adapter_names`) on "
              f"transformers {v['transformers']}, torch {v['torch']} with {s['torch_threads']} threads, in a "
              "process of its own. One family after another, its paths and Llama's base and 16-adapter "
              "batches interleaved round by round; tokens/s the median of the rounds (their range in "
              "brackets), ratios the median of the per-round ratios (range in brackets); over Llama's: the "
              "family's 16 adapters / base over Llama's in the same round, the median over the rounds "
              "(Llama's own in those rounds in families.json, `reference_over_base`). "
              f"{compiles} compiles while timing.",
              "", *target_lines(result), "",
              f"{mach['nproc']} CPUs ({mach.get('cpu', 'model not recorded')}; kernels built for "
              f"{', '.join(mach.get('kernel_isas') or ['no vector ISA recorded'])}), Python {mach['python']}, "
              f"jax {v['jax']}, load average {result['load_average_before'][0]:.2f} before the run, "
              f"{result['load_average_after'][0]:.2f} after, {mach['date']}. A round counts where other "
              f"processes used under {100 * CONTENDED:.0f}% of the CPUs in each of its measurements"
              + (f"; **{', '.join(disturbed)}: fewer than {s['repeats']} undisturbed rounds, their figures "
                 "are of every round run and less reliable**" if disturbed else "")
              + f". `python -m benchmarks.bench_families` reproduces it ({result['seconds']:.0f} s); "
              "`benchmarks/results/families.json` has every round."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--steps", type=int, default=8, help="decode steps per timed round")
    ap.add_argument("--repeats", type=int, default=5,
                    help="timed rounds without other load wanted per family (after one warm-up round)")
    ap.add_argument("--max-rounds", type=int, default=0,
                    help="give up waiting for undisturbed rounds after this many (default: 2 x --repeats)")
    ap.add_argument("--max-len", type=int, default=256, help="KV-cache positions per row (bench_decode's)")
    ap.add_argument("--slots", type=int, default=64, help=f"pool slots (bench_decode's); {ADAPTERS} are filled")
    ap.add_argument("--torch-threads", type=int, default=os.cpu_count() or 1,
                    help="torch.set_num_threads for PEFT (XLA uses every core)")
    ap.add_argument("--families", default="",
                    help=f"comma-separated families to run (default all: {', '.join(f.family for f in FAMILIES)}; "
                         f"{REFERENCE} always runs, the others are compared with it); others than all need --no-write")
    output_flags(ap, "families", f"a smoke run: a tiny model, {' and '.join(QUICK_FAMILIES)}, one round of 4 steps; "
                 "writes nothing unless `python -m benchmarks --quick` points it elsewhere")
    args = ap.parse_args(argv)
    known = {f.family: f for f in FAMILIES}
    wanted = [n for n in args.families.split(",") if n]
    unknown = [n for n in wanted if n not in known]
    if unknown:
        ap.error(f"--families: {', '.join(unknown)} not among {', '.join(known)}")
    if args.quick:
        args.steps, args.repeats, args.max_rounds, args.max_len = 4, 1, 1, 64
        args.torch_threads = 1  # as bench_decode's: PEFT's threads spin more than they work here
        wanted = wanted or list(QUICK_FAMILIES)
    if wanted and set(wanted) != set(known) and not (args.no_write or args.quick):
        ap.error("--families other than all of them needs --no-write (results/ keeps every family)")
    args.max_rounds = max(args.repeats, args.max_rounds or 2 * args.repeats)
    if PROMPT + args.steps > args.max_len:
        ap.error(f"--max-len {args.max_len} is too short for {args.steps} steps after a {PROMPT}-token prompt")
    if args.slots < ADAPTERS:
        ap.error(f"--slots must be at least {ADAPTERS}, the adapters the batch mixes")
    names = {REFERENCE, *wanted} if wanted else set(known)
    chosen = [f for f in FAMILIES if f.family in names]  # the table's order: Llama first
    result = run(args, chosen)
    markdown = render(result)
    console.print(markdown)
    publish("families", result, markdown, quick=args.quick, no_write=args.no_write, say=console.print)
    return 0


def figures(r: dict[str, Any]) -> list[Figure]:
    """Per family (issue 38): decode tokens/s on 16 adapters, 16 adapters / its base model, ours /
    PEFT on the same batch, and the family's 16 adapters / base over Llama's (target >= 0.9x)."""
    out, steps, batch = [], r["settings"]["steps"], r["settings"]["batch"]
    k = r["adapters"]["count"]
    for name, c in r["families"].items():
        rates = decode_rates(c["adapters"], batch * steps)
        label = f"decode, {name}, {k} distinct adapters"
        out += [figure("families", label, median(rates), "tokens/s", spread=spread(rates), runs=len(rates)),
                figure("families", f"{label} / base model", c["over_base"], "x", spread=c["over_base_spread"],
                       runs=len(rates)),
                figure("families", f"{label}: ours / PEFT mixed batch", c["over_peft"], "x",
                       spread=c["over_peft_spread"], runs=len(rates))]
    for t in r["targets"]:
        out.append(figure("families", f"decode, {t['name']}", t["measured"], "x", target=t["target"],
                          meets=t["met"]))
    return out


if __name__ == "__main__":
    sys.exit(main())
