"""Structured outputs (issue 49): what a grammar costs the batch that carries it.

A 32-row batch on one in-process Engine (the base model, no adapters: grammars are what is
measured) over bench_decode's 8-layer checkpoint (hidden 1,024, vocabulary 8,192, float32)
with the example tokenizer trained to that vocabulary. The same 32 requests (16-token prompts,
64 new tokens at temperature 1, a seed each) run twice per round, alternated: once plain and
once with 16 of them carrying a JSON schema each (16 distinct schemas: arrays of objects with
bounded integers, enums and booleans, at least 100 items, so no row can finish early and both
batches generate the same tokens). Each figure is the median over `--rounds` rounds, after one
unmeasured round of each (it compiles the shapes and the grammars: compiles are cached by
schema, as serving caches them), which batch goes first alternating. Target: tokens/s with
grammars >= 0.85x without. Beside it, the same ratio in tokens per CPU-second of this process
(on a machine shared with other work, the wall-clock ratio moves with their load) and the
grammar hooks' own host time per step.

Grammar compiles (llguidance, against the 8,192-token vocabulary): `--compiles` distinct
schemas, each compiled once on the replica's compile thread; p50 and p99 of their seconds.

    .venv/bin/python -m benchmarks.bench_structured [--rounds 5] [--compiles 200] [--quick] [--no-write]

In `make bench` as `structured`: benchmarks/results/structured.json, its section of
docs/results-detail.md (bench:structured) and its figures in latest.json.
"""
from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from benchmarks.decode_paths import QUICK_SHAPE, SHAPE
from benchmarks.harness import (Figure, figure, machine_info, median, output_flags, percentile,
                                run_and_publish, spread)
from computed.model.loader import load_model
from computed.model.runner import Runner
from computed.serving import grammar
from computed.serving.engine import Engine
from computed.serving.grammar import Grammars
from shared.grammar import json_schema
from shared.replica_protocol import generate_args
from statesvc.tools.example import write_model
from statesvc.tools.tokenizer import write_tokenizer
from testkit.ports import BaseOnly

BATCH, CONSTRAINED, PROMPT, NEW = 32, 16, 16, 64
TARGET = 0.85


def long_schema(rng: random.Random) -> dict[str, Any]:
    """An array of at least 100 objects: no row carrying it ends within NEW tokens."""
    item = {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": rng.randint(0, 50), "maximum": rng.randint(100, 9999)},
        "tag": {"enum": rng.sample(["red", "green", "blue", "cyan", "gold", "gray"], 3)},
        "ok": {"type": "boolean"}}, "required": ["id", "tag", "ok"], "additionalProperties": False}
    return {"type": "object", "properties": {"items": {"type": "array", "items": item,
                                                       "minItems": 100}},
            "required": ["items"], "additionalProperties": False}


def compile_schema(rng: random.Random, i: int) -> dict[str, Any]:
    """A schema of the kind requests send: a few typed fields, an enum, a nested object."""
    props: dict[str, Any] = {f"f{j}": rng.choice([
        {"type": "integer", "minimum": 0, "maximum": rng.randint(1, 10**6)},
        {"type": "string", "maxLength": rng.randint(1, 64)},
        {"enum": [f"v{i}_{k}" for k in range(rng.randint(2, 8))]},
        {"type": "array", "items": {"type": "number"}, "maxItems": rng.randint(1, 20)},
        {"type": "object", "properties": {"x": {"type": "boolean"}, "y": {"type": "string"}},
         "required": ["x"]}]) for j in range(rng.randint(2, 8))}
    return {"type": "object", "properties": props, "required": sorted(props)}


class GrammarClock:
    """The host time spent in the grammar hooks (`mask` before a row's sample, `advance`
    after), timed around the engine's own calls."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.real = (grammar.mask, grammar.advance)

        def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
            def call(*a: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return fn(*a)
                finally:
                    self.seconds += time.perf_counter() - t0
            return call
        grammar.mask, grammar.advance = timed(grammar.mask), timed(grammar.advance)  # type: ignore[method-assign]

    def close(self) -> None:
        grammar.mask, grammar.advance = self.real  # type: ignore[method-assign]


def one_batch(engine: Engine, prompts: np.ndarray, grammars: list[dict[str, str] | None]
              ) -> tuple[float, float, int]:
    """Wall and CPU seconds (this process, every thread) and tokens of one batch, submit to
    the last request's end."""
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(BATCH):
        done = engine.submit(f"r{i}", generate_args([int(t) for t in prompts[i]], max_new_tokens=NEW,
                                                   temperature=1.0, seed=i, grammar=grammars[i]),
                             None)
        assert done is None, done
    results = []
    while len(results) < BATCH:
        for d in engine.step():
            if d.error is not None:
                raise RuntimeError(f"{d.req_id}: {d.error}")
            results.append(d.result)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = sum(len(r["output_ids"]) for r in results if r is not None)
    if tokens != BATCH * NEW:
        raise RuntimeError(f"{tokens} tokens, not {BATCH * NEW}: a row ended early")
    return seconds, cpu, tokens


def run(args: argparse.Namespace) -> dict[str, Any]:
    shape = QUICK_SHAPE if args.quick else SHAPE
    rng = random.Random(49)
    with tempfile.TemporaryDirectory(prefix="bench-structured-") as tmp:
        model_dir = write_model(Path(tmp) / "model", shape, seed=0)
        write_tokenizer(model_dir, vocab_size=shape.vocab_size, max_len=shape.max_position_embeddings)
        config, params = load_model(model_dir)
        runner = Runner(config, params, max_batch=BATCH, max_len=PROMPT + NEW + 16)
        grammars = Grammars.load(model_dir, vocab_size=runner.vocab_size)
        assert grammars is not None
        engine = Engine(runner, BaseOnly(), grammars=grammars)
        engine.warm = True
        prompts = np.random.default_rng(0).integers(3, shape.vocab_size, (BATCH, PROMPT))
        schemas = [json_schema(long_schema(rng)).wire() for _ in range(CONSTRAINED)]
        # constrained rows spread over the batch: every other row
        mixed: list[dict[str, str] | None] = [schemas[i // 2] if i % 2 == 0 else None
                                              for i in range(BATCH)]
        plain: list[dict[str, str] | None] = [None] * BATCH
        one_batch(engine, prompts, plain)  # compiles the shapes
        one_batch(engine, prompts, mixed)  # and the 16 grammars (cached from here on)
        rounds: list[dict[str, float]] = []
        clock = GrammarClock()
        for k in range(args.rounds):  # which batch goes first alternates
            first, second = (plain, mixed) if k % 2 == 0 else (mixed, plain)
            a, b = one_batch(engine, prompts, first), one_batch(engine, prompts, second)
            (s_plain, c_plain, n), (s_mixed, c_mixed, _) = (a, b) if k % 2 == 0 else (b, a)
            rounds.append({"plain_tok_s": n / s_plain, "grammar_tok_s": n / s_mixed,
                           "ratio": s_plain / s_mixed, "cpu_ratio": c_plain / c_mixed})
        clock.close()
        steps = args.rounds * NEW  # decode steps (and the prefill's token) of the mixed batches
        before = len(grammars.compile_s)
        for i in range(args.compiles):
            grammars.compile(json_schema(compile_schema(rng, i))).result()
        compiles = grammars.compile_s[before:]
        grammars.close()
    ratio = median([r["ratio"] for r in rounds])
    plain_step_ms = 1e3 * BATCH / median([r["plain_tok_s"] for r in rounds])
    return {
        "bench": "structured", "machine": machine_info(), "cpus": os.cpu_count(),
        "shape": {"vocab_size": shape.vocab_size, "hidden_size": shape.hidden_size,
                  "layers": shape.num_hidden_layers},
        "batch": BATCH, "rows_with_grammar": CONSTRAINED, "new_tokens": NEW,
        "plain_tok_s": median([r["plain_tok_s"] for r in rounds]),
        "grammar_tok_s": median([r["grammar_tok_s"] for r in rounds]),
        "ratio": ratio, "target": TARGET, "meets_target": ratio >= TARGET,
        # tokens per CPU-second (this process's threads) with / without: what other processes
        # on the machine take from the wall-clock figure is not in it
        "cpu_ratio": median([r["cpu_ratio"] for r in rounds]),
        # the grammar hooks' own host time per step, 16 rows' masks and advances together,
        # beside a plain step's wall time
        "grammar_ms_per_step": clock.seconds * 1e3 / steps, "plain_step_ms": plain_step_ms,
        "rounds": rounds, "load_average": os.getloadavg(),
        "compile_ms": {"count": len(compiles), "p50": percentile(compiles, 50) * 1e3,
                       "p99": percentile(compiles, 99) * 1e3, "max": max(compiles) * 1e3},
    }


def report(r: dict[str, Any]) -> str:
    c, sh, m = r["compile_ms"], r["shape"], r["machine"]
    return "\n".join([
        "| batch of 32 | tokens/s | with / without | target |",
        "|---|---:|---:|---|",
        f"| without grammars | {r['plain_tok_s']:,.0f} | | |",
        f"| 16 rows with a json_schema | {r['grammar_tok_s']:,.0f} | {r['ratio']:.3f}x | >= {r['target']}x |",
        f"| the same per CPU-second | | {r['cpu_ratio']:.3f}x | |",
        "",
        f"- {'PASS' if r['meets_target'] else 'MISS'}: 16 of 32 rows with a json_schema, tokens/s with / "
        f"without {r['ratio']:.3f} (target >= {r['target']}x)",
        "",
        f"Grammar hooks (masks and advances of the 16 rows) {r['grammar_ms_per_step']:.2f} ms a step beside a "
        f"plain step's {r['plain_step_ms']:.1f} ms. Grammar compiles (llguidance, {c['count']} distinct "
        f"schemas against the {sh['vocab_size']:,}-token vocabulary): p50 {c['p50']:.1f} ms, p99 {c['p99']:.1f} ms, "
        f"max {c['max']:.1f} ms. {r['new_tokens']} new tokens a row at temperature 1, "
        f"{sh['layers']}-layer hidden-{sh['hidden_size']} model, median of {len(r['rounds'])} rounds, the two "
        f"batches alternated (`python -m benchmarks.bench_structured`); on {m['cpu']}, {r['cpus']} CPUs, "
        f"load average {r['load_average'][0]:.1f}."])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--compiles", type=int, default=200)
    output_flags(ap, "structured", "the small checkpoint, 2 rounds, 20 compiles")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.compiles = min(args.rounds, 2), min(args.compiles, 20)
    return run_and_publish("structured", args, run, report)


def figures(r: dict[str, Any]) -> list[Figure]:
    """Issue 49: what 16 json_schema rows cost a batch of 32, and the grammars' compile times."""
    runs = len(r["rounds"])
    return [
        figure("structured", "16 of 32 rows with a json_schema, tokens/s with / without", r["ratio"], "x",
               target=f">= {r['target']}x", meets=r["meets_target"],
               spread=spread([x["ratio"] for x in r["rounds"]]), runs=runs),
        figure("structured", "16 of 32 rows with a json_schema, tokens per CPU-second with / without",
               r["cpu_ratio"], "x", spread=spread([x["cpu_ratio"] for x in r["rounds"]]), runs=runs),
        figure("structured", "grammar compile p50", r["compile_ms"]["p50"], "ms"),
        figure("structured", "grammar compile p99", r["compile_ms"]["p99"], "ms"),
    ]


if __name__ == "__main__":
    raise SystemExit(main())
