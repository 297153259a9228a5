"""bench_decode's section of docs/results-detail.md: its tables, what they compare, and the machine they ran on."""
from __future__ import annotations

from typing import Any

from benchmarks.decode_paths import GATHER, LOOP, PATHS, RANK, TARGET_MIX
from benchmarks.harness.stats import CONTENDED
from benchmarks.harness import median, target_lines
from shared.projections import MODULES
from statesvc.tools.example import ModelShape


def mixes_of(result: dict[str, Any]) -> list[int]:
    """The mixes (distinct adapters per batch) the run timed."""
    return sorted(int(k) for k in result["results"])


def _mix_label(k: int) -> str:
    return "base model" if k == 0 else f"{k} adapter" + ("s" if k > 1 else "")


def render(result: dict[str, Any]) -> str:
    s, m, MIXES = result["settings"], result["model"], mixes_of(result)  # noqa: N806
    lines = ["| distinct adapters | ours tok/s (decode) | ours tok/s (Engine.step) | XLA only tok/s "
             "| per-token gather tok/s | PEFT tok/s | ours / base (decode, Engine, loop) | decode / loop "
             "| decode / gather | ours / PEFT (decode, Engine, loop) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def rate(cell: dict[str, Any]) -> str:  # the median and the spread of the rounds
        lo, hi = cell["tokens_per_s_spread"]
        return f"{cell['tokens_per_s']:,.0f} ({lo:,.0f}-{hi:,.0f})"

    for k in MIXES:
        r = result["results"][str(k)]
        d, e, p = r["decode"], r["engine"], r["peft"]
        g, lp = (rate(r[a]) if a in r else "-" for a in (GATHER, LOOP))
        over_g, over_l = (f"{d[f'over_{a}']:.2f}" if f"over_{a}" in d else "-" for a in (GATHER, LOOP))
        l_base, l_peft = (f"{r[LOOP][f'over_{n}']:.2f}" if LOOP in r else "-" for n in ("base", "peft"))
        lines.append(f"| {_mix_label(k)} | {rate(d)} | {rate(e)} | {lp} | {g} | {rate(p)} "
                     f"| {d['over_base']:.2f}, {e['over_base']:.2f}, {l_base} | {over_l} | {over_g} "
                     f"| {d['over_peft']:.2f}, {e['over_peft']:.2f}, {l_peft} |")
    served = result.get("served")
    if served:
        lines += ["", "| distinct adapters | served tok/s | in process (Engine.step) tok/s | PEFT tok/s "
                  "| served / served base | served / in process | served / PEFT |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for k in MIXES:
            c = served[str(k)]
            peft, over_peft = (rate(c["peft"]), f"{c['over_peft']:.2f}") if "peft" in c else ("-", "-")
            lines.append(f"| {_mix_label(k)} | {rate(c)} | {rate(c['engine'])} | {peft} "
                         f"| {c['over_base']:.2f} | {c['over_engine']:.2f} | {over_peft} |")
        lines += ["", f"Whole requests, the same work three ways: {s['served_clients']} requests (row i: "
                  f"prompt i, adapter i % k), {s['served_tokens']} new tokens each (greedy), timed from the "
                  "first request to the last token, prefill included. Served: a real `statesvc serve` and "
                  f"`computed serve --max-batch {s.get('served_max_batch', s['batch'])}` (subprocesses, the "
                  "same model and adapters, "
                  "loaded through the state service), one ZeroMQ DEALER per request, all sent at once; in "
                  "process: `Engine.submit` of the same requests and `Engine.step` until the last one "
                  "finishes (prefills as the engine admits them, as in the replica); PEFT: the same prompts "
                  "prefilled as one batch, then greedy decoding with the KV cache (timed on {TARGET_MIX} "
                  "adapters only, the target's batch: it takes about four times as long as ours). In the same "
                  "rounds as the decode figures; ratios per round."]
    v = result["versions"]
    lines += ["",
              f"Model (random, written by statesvc/tools/example.py): vocab {m['vocab_size']}, hidden "
              f"{m['hidden_size']}, intermediate {m['intermediate_size']}, {m['num_hidden_layers']} layers, "
              f"{m['num_attention_heads']} heads, {m['num_key_value_heads']} KV heads, head_dim {m['head_dim']}, "
              f"{m['parameters'] / 1e6:.0f} M parameters, float32. {result['adapters']['count']} adapters, "
              f"r={result['adapters']['rank']}, alpha {result['adapters']['alpha']}, all seven target modules; "
              f"pool of {s['slots']} slots, {s['pool_dtype']}; KV cache of {s['max_len']} positions. Row i uses "
              f"adapter i % k; prompts of {s['prompt']} tokens, then greedy decoding. tokens/s: the median "
              f"of the rounds (their range in brackets). decode: "
              f"`Runner.decode` (`computed.model.runner.decode` as the engine calls it: projections from the "
              f"native dense kernel `computed/backend/kernels/dense.cc` over packed weights, LoRA from `sgmv.cc`, "
              f"attention from `attention.cc`) in a loop; XLA only: the same "
              f"loop without the native kernels, as a replica runs where they cannot be built (XLA's dot, LoRA from "
              f"XLA's window loop `lora.segmented_group`, attention over the length bucket); per-token "
              f"gather: the same loop with the LoRA terms from A and B gathered for every row "
              f"(BGMV-style, the backend's `lora=\"gather\"`, never used in serving); Engine.step: "
              f"the serving loop with host sampling; PEFT {v['peft']} mixed-batch inference (`adapter_names`) "
              f"on transformers {v['transformers']} ({m['attn_implementation']} attention), torch {v['torch']} "
              f"with {s['torch_threads']} threads.",
              ""]
    lines += target_lines(result)
    lines += ["", notes(result), "", machine_line(result)]
    return "\n".join(lines)


def shares(result: dict[str, Any], paths: tuple[str, ...], key: str) -> list[float]:
    """`key` over the rounds the figures are taken from, for every mix and each of `paths`."""
    out = []
    for row in result["results"].values():
        for p in paths:
            used = row[p]["used_rounds"]
            out += [x for i, x in enumerate(row[p][key]) if used is None or i in used]
    return out


def machine_line(result: dict[str, Any]) -> str:
    s = result["settings"]
    clean = len(s["clean_rounds"])
    ours, theirs = shares(result, ("decode", "engine"), "cpu_share"), shares(result, ("peft",), "cpu_share")
    others = shares(result, PATHS, "others_share")
    m, backend = result["machine"], result.get("backend") or {}
    line = (f"{m['nproc']} CPUs ({m.get('cpu', 'model not recorded')}; kernels built for "
            f"{', '.join(m.get('kernel_isas') or ['no vector ISA recorded'])}; the decode column "
            f"on {backend.get('name', 'an unrecorded backend')}), Python {m['python']}, jax "
            f"{result['versions']['jax']}, load average {result['load_average_before'][0]:.2f} before the run, "
            f"{result['machine']['date']}. {s['rounds_run']} rounds run; the medians are of "
            + (f"the {clean} that ran without other load (other processes under {100 * CONTENDED:.0f}% of "
               "the CPUs in every measurement)" if clean else "all of them: none ran without other load")
            + f". In those, our process used {100 * median(ours):.0f}% of the CPUs (median), PEFT's "
            f"{100 * median(theirs):.0f}%, other processes {100 * median(others):.0f}% (at most "
            f"{100 * max(others):.0f}%).")
    if clean < s["repeats"]:
        line += (f" **Fewer than {s['repeats']} undisturbed rounds: the figures are unreliable, PEFT's above "
                 "all (torch's threads wait for each other when one is descheduled).**")
    return (line + f" `python -m benchmarks.bench_decode` reproduces it ({result['seconds']:.0f} s); "
            "`benchmarks/results/decode.json` has every round.")


def adapter_fraction(shape: ModelShape, adapters: int) -> float:
    """Parameters of `adapters` adapters over those of the projections they adapt (all layers)."""
    dims = [shape.module_dims(m) for m in MODULES]
    return adapters * RANK * sum(i + o for i, o in dims) / sum(i * o for i, o in dims)


def notes(result: dict[str, Any]) -> str:
    MIXES = mixes_of(result)  # noqa: N806
    base = result["results"]["0"]["decode"]["tokens_per_s"]
    g, nb = result["gemm_gflops"], result["no_pool_base"]["tokens_per_s"]
    notes = [f"At this shape {TARGET_MIX} adapters hold "
             f"{100 * result['adapters']['fraction_of_projections']:.0f}% as many parameters as "
             "the projections they adapt (about 10% at hidden 4096, intermediate 11008), so the LoRA "
             "share of a step is large.",
             f"The base batch through `decode` with no LoRA pool makes {nb:,.0f} tokens/s "
             f"({nb / base:.2f}x the pooled figure): what the LoRA path costs when no row uses it.",
             f"One [32, 1024] x [1024, 2816] float32 product (the MLP's) runs at {g['xla']} GFLOP/s in XLA"
             + (f", {g['kernel']} in the dense kernel" if g.get("kernel") else "")
             + f" and {g['torch']} in torch here (one weight, hot in the cache; a step reads each "
             "weight once, from memory)."]
    lb = result["long_cache_base"]
    if lb and lb["used_rounds"] is None:
        notes.append(f"With a {lb['max_len']}-position cache: not measured without other load.")
    elif lb:
        notes.append(f"With a {lb['max_len']}-position cache, the base batch at the same positions makes "
                     f"{lb['tokens_per_s']:,.0f} tokens/s, {lb['tokens_per_s'] / base:.2f}x the figure above "
                     "(a step reads the positions its rows hold, not the cache).")
    lc = result.get("long_context")
    if lc:
        notes.append(f"Deep in that cache (every row from position {lc['start']} on), the base batch makes "
                     f"{lc['kernel']['tokens_per_s']:,.0f} tokens/s with the attention kernel and "
                     f"{lc['xla']['tokens_per_s']:,.0f} with XLA's attention over the bucket: "
                     f"{lc['kernel_over_xla']:.2f}x.")
    agree = result["tokens_agree"]
    notes.append("Greedy tokens agree with PEFT's on "
                 + ", ".join(f"{100 * agree[str(k)]['decode_vs_peft']:.0f}%" for k in MIXES)
                 + f" of (step, row) pairs ({', '.join(str(k) for k in MIXES)} adapters), the per-token "
                 "gather's with ours on "
                 + ", ".join(f"{100 * agree[str(k)]['decode_vs_gather']:.0f}%" for k in MIXES if k)
                 + ", the window loop's on "
                 + ", ".join(f"{100 * agree[str(k)]['decode_vs_loop']:.0f}%" for k in MIXES if k)
                 + f"; {result['compiles_while_timing']} compiles while timing.")
    return " ".join(notes)


