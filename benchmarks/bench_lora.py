"""Multi-LoRA linear layer on decode-shaped inputs: the base matmul, a naive gather, grouped schemes.

One linear layer `y = x W + scaling[s] * B[s] (A[s] x)` for N rows (one decode
step of N sequences), hidden -> hidden, rank r, a pool of `--slots` slots, with
1, 4 and 16 distinct slots in the batch (every fifth row on the base model).
Timed side by side in one run, interleaved, best of `--repeats` rounds:

* base:            `x @ W` alone, the floor.
* gather:          base + the naive per-row gather: `A[slots]`, `B[slots]` ([N, r, in] and
                   [N, out, r] copies), then batched matvecs. What the model must not do.
* windows2/8/16:   base + computed.model.lora.segmented with windows of 2, 8 and 16 rows: each
                   slot's rows padded to whole windows; a loop over the windows in use takes
                   the window's slot's A and B by dynamic index and multiplies the window's
                   rows (SGMV-style). The model picks the window per decode step from the
                   batch's mix (`lora.choose_window`, among `lora.loop_windows(batch)`, on the XLA backend).
* slot_loop:       a loop over the distinct slots in use, each applied to every row, masked
                   to its own: reads each slot's weights once but does N * distinct rows of work.
* ragged_pool:     base + `jax.lax.ragged_dot` over rows sorted by slot, one group per pool slot.
* ragged_distinct: the same with one group per distinct slot (their weights gathered).
* blocked8:        rows sorted by slot and packed into blocks of 8 rows owned by one
                   slot; weights gathered per block; one batched matmul.
* dense_distinct:  the distinct slots' A stacked into one [M*r, in] matrix: one matmul for
                   every row against every distinct slot, a mask keeps each row's own block,
                   one matmul back through the stacked B.

Every variant is checked against the gather's result, and each is compiled once
per hidden size: changing the mix of slots must not recompile (counted).

    .venv/bin/python -m benchmarks.bench_lora [--hidden 1024 2048] [--rows 32] [--rank 16] ...

The table is printed, written to benchmarks/results/lora.json and, when
README.md has `<!-- bench:lora:start -->` / `<!-- bench:lora:end -->` markers,
into that section. The fastest grouped variant (geometric mean over the cases)
is named at the end, beside the window the model would choose for each case.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from rich.console import Console
from rich.table import Table

from benchmarks.report import machine_info, update_readme, write_results
from computed.model import lora
from testkit.jaxcount import counting_compiles

console = Console() if sys.stdout.isatty() else Console(width=170)

Variant = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]

# ragged_dot over rows: lhs [N, in] contracts its dim 1 with dim 2 of rhs [G, r, in] / [G, out, r].
_RAGGED = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((1,), (2,)), ((), ())),
                                            lhs_ragged_dimensions=(0,), rhs_group_dimensions=(0,))


def _row_scale(slots: jax.Array, scaling: jax.Array) -> jax.Array:
    return jnp.where(slots >= 0, scaling[jnp.maximum(slots, 0)], 0.0)[:, None]


def gather(x: jax.Array, A: jax.Array, B: jax.Array, scaling: jax.Array, slots: jax.Array) -> jax.Array:
    s = jnp.maximum(slots, 0)
    t = jnp.einsum("ni,nri->nr", x, A[s])
    return jnp.einsum("nr,nor->no", t, B[s]) * _row_scale(slots, scaling)


def windows(x: jax.Array, A: jax.Array, B: jax.Array, scaling: jax.Array, slots: jax.Array, *,
            window: int) -> jax.Array:
    return lora.segmented(x, A, B, scaling, lora.segments(slots, A.shape[0], window=window))


def slot_loop(x: jax.Array, A: jax.Array, B: jax.Array, scaling: jax.Array, slots: jax.Array) -> jax.Array:
    S = A.shape[0]
    present = jnp.zeros((S,), jnp.bool_).at[slots].set(True, mode="drop")  # base rows dropped
    (distinct,) = jnp.nonzero(present, size=min(x.shape[0], S), fill_value=0)

    def one_slot(i: jax.Array, y: jax.Array) -> jax.Array:
        u = distinct[i]
        a = jax.lax.dynamic_index_in_dim(A, u, 0, keepdims=False)
        b = jax.lax.dynamic_index_in_dim(B, u, 0, keepdims=False)
        return y + jnp.where((slots == u)[:, None], x @ a.T, 0) @ b.T

    y = jax.lax.fori_loop(0, jnp.sum(present), one_slot, jnp.zeros((x.shape[0], B.shape[1]), x.dtype))
    return y * _row_scale(slots, scaling)


def _sorted(slots: jax.Array, num_slots: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    key = jnp.where(slots >= 0, slots, num_slots)  # base rows sort last
    order = jnp.argsort(key, stable=True)
    return key, order, jnp.argsort(order), jnp.bincount(key, length=num_slots + 1)


def ragged_pool(x: jax.Array, A: jax.Array, B: jax.Array, scaling: jax.Array, slots: jax.Array) -> jax.Array:
    S = A.shape[0]
    _, order, inverse, counts = _sorted(slots, S)
    t = jax.lax.ragged_dot_general(x[order], A, counts[:S], _RAGGED)  # base rows: in no group, zero
    y = jax.lax.ragged_dot_general(t, B, counts[:S], _RAGGED)
    return y[inverse] * _row_scale(slots, scaling)


def ragged_distinct(x: jax.Array, A: jax.Array, B: jax.Array, scaling: jax.Array, slots: jax.Array) -> jax.Array:
    S, M = A.shape[0], min(x.shape[0], A.shape[0])
    _, order, inverse, counts = _sorted(slots, S)
    present = counts[:S] > 0
    (distinct,) = jnp.nonzero(present, size=M, fill_value=0)
    sizes = jnp.where(jnp.arange(M) < jnp.sum(present), counts[distinct], 0)
    t = jax.lax.ragged_dot_general(x[order], A[distinct], sizes, _RAGGED)
    y = jax.lax.ragged_dot_general(t, B[distinct], sizes, _RAGGED)
    return y[inverse] * _row_scale(slots, scaling)


def blocked(x: jax.Array, A: jax.Array, B: jax.Array, scaling: jax.Array, slots: jax.Array, *,
            block: int) -> jax.Array:
    S, n_in = A.shape[0], x.shape[1]
    n_blocks = -(-(x.shape[0] + min(x.shape[0], S) * (block - 1)) // block)  # worst case
    key, _, inverse, counts = _sorted(slots, S)
    rank = inverse - (jnp.cumsum(counts) - counts)[key]      # index of a row within its slot's rows
    per_slot = -(-counts[:S] // block)
    first = jnp.cumsum(per_slot) - per_slot
    blk = jnp.where(slots >= 0, first[jnp.minimum(key, S - 1)] + rank // block, n_blocks)  # base: dropped
    lane = rank % block
    xb = jnp.zeros((n_blocks, block, n_in), x.dtype).at[blk, lane].set(x, mode="drop")
    owner = jnp.zeros((n_blocks,), jnp.int32).at[blk].set(key, mode="drop")
    t = jnp.einsum("kti,kri->ktr", xb, A[owner])
    yb = jnp.einsum("ktr,kor->kto", t, B[owner])
    return yb.at[blk, lane].get(mode="fill", fill_value=0) * _row_scale(slots, scaling)


def dense_distinct(x: jax.Array, A: jax.Array, B: jax.Array, scaling: jax.Array, slots: jax.Array) -> jax.Array:
    S, r, n_in = A.shape
    N, M = x.shape[0], min(x.shape[0], A.shape[0])
    key = jnp.where(slots >= 0, slots, S)
    present = jnp.bincount(key, length=S + 1)[:S] > 0
    (distinct,) = jnp.nonzero(present, size=M, fill_value=0)
    segment = jnp.where(slots >= 0, (jnp.cumsum(present) - 1)[jnp.maximum(slots, 0)], M)
    t = (x @ A[distinct].reshape(M * r, n_in).T).reshape(N, M, r)
    t = jnp.where((jnp.arange(M)[None, :] == segment[:, None])[:, :, None], t, 0).reshape(N, M * r)
    return (t @ jnp.swapaxes(B[distinct], 1, 2).reshape(M * r, -1)) * _row_scale(slots, scaling)


VARIANTS: dict[str, Variant] = {
    "gather": gather,
    "windows2": partial(windows, window=2),
    "windows8": partial(windows, window=8),
    "windows16": partial(windows, window=16),
    "slot_loop": slot_loop,
    "ragged_pool": ragged_pool,
    "ragged_distinct": ragged_distinct,
    "blocked8": partial(blocked, block=8),
    "dense_distinct": dense_distinct,
}
GROUPED = [k for k in VARIANTS if k != "gather"]
MODEL_CHOICE = "windows" + "/".join(str(w) for w in lora.WINDOWS) + " (chosen per step)"


def _layer(variant: Variant | None) -> Callable[..., jax.Array]:
    if variant is None:
        return jax.jit(lambda x, W, A, B, scaling, slots: x @ W)
    return jax.jit(lambda x, W, A, B, scaling, slots: x @ W + variant(x, A, B, scaling, slots))


def mix(rng: np.random.Generator, rows: int, slots: int, distinct: int) -> np.ndarray:
    chosen = rng.choice(slots, distinct, replace=False)
    out = chosen[np.arange(rows) % distinct].astype(np.int32)  # every chosen slot is used
    rng.shuffle(out)
    out[::5] = lora.BASE
    return out


def run(hidden: int, rows: int, rank: int, num_slots: int, mixes: list[int], repeats: int,
        inner: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(hidden)
    W = jnp.asarray(rng.standard_normal((hidden, hidden), np.float32) / np.sqrt(hidden))
    A = jnp.asarray(rng.standard_normal((num_slots, rank, hidden), np.float32) / np.sqrt(hidden))
    B = jnp.asarray(rng.standard_normal((num_slots, hidden, rank), np.float32) / np.sqrt(rank))
    scaling = jnp.asarray(rng.uniform(0.5, 2.0, num_slots).astype(np.float32))
    x = jnp.asarray(rng.standard_normal((rows, hidden), np.float32))
    fns = {"base": _layer(None)} | {k: _layer(v) for k, v in VARIANTS.items()}
    cases = []
    for n, distinct in enumerate(mixes):
        slots = jnp.asarray(mix(rng, rows, num_slots, distinct))
        ref = np.asarray(fns["gather"](x, W, A, B, scaling, slots))
        with counting_compiles() as compiles:
            for name, fn in fns.items():
                out = np.asarray(fn(x, W, A, B, scaling, slots))
                if name != "base":
                    err = float(np.abs(out - ref).max())
                    if err > 1e-3 * float(np.abs(ref).max()):
                        raise AssertionError(f"{name} differs from the gather by {err:.2e}")
        if n and compiles:
            raise AssertionError(f"{len(compiles)} compiles when the mix of slots changed")
        times: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(repeats):
            for name, fn in fns.items():
                start = time.perf_counter()
                for _ in range(inner):
                    out = fn(x, W, A, B, scaling, slots)
                jax.block_until_ready(out)
                times[name].append((time.perf_counter() - start) / inner * 1e3)
        cases.append({"hidden": hidden, "distinct": distinct,
                      "ms": {k: min(v) for k, v in times.items()},
                      "ms_median": {k: float(np.median(v)) for k, v in times.items()}})
    return cases


def fastest_grouped(cases: list[dict[str, Any]]) -> tuple[str, dict[str, float]]:
    """The grouped variant with the lowest geometric mean time; and every variant's mean."""
    means = {k: math.exp(sum(math.log(c["ms"][k]) for c in cases) / len(cases)) for k in ["base", *VARIANTS]}
    return min(GROUPED, key=lambda k: means[k]), means


def markdown(cases: list[dict[str, Any]], settings: dict[str, Any], choice: str) -> str:
    names = ["base", *VARIANTS]
    lines = [f"One linear layer, {settings['rows']} decode rows, rank {settings['rank']}, "
             f"{settings['slots']} pool slots, float32, ms per call (best of {settings['repeats']}); "
             f"{settings['nproc']} CPUs, jax {jax.__version__}.", "",
             "| hidden | distinct | " + " | ".join(names) + " |",
             "|---|---|" + "---|" * len(names)]
    for c in cases:
        lines.append(f"| {c['hidden']} | {c['distinct']} | "
                     + " | ".join(f"{c['ms'][k]:.3f}" for k in names) + " |")
    lines += ["", f"Fastest grouped variant: **{choice}** (computed/model/lora.py uses `{MODEL_CHOICE}`)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--hidden", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--slots", type=int, default=32, help="pool slots (max_loras)")
    ap.add_argument("--distinct", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--inner", type=int, default=10, help="calls per timed round")
    ap.add_argument("--no-write", action="store_true", help="print only; no results file or README")
    args = ap.parse_args(argv)
    if max(args.distinct) > min(args.rows, args.slots):
        ap.error("--distinct cannot exceed --rows or --slots")

    cases = []
    for hidden in args.hidden:
        cases += run(hidden, args.rows, args.rank, args.slots, args.distinct, args.repeats, args.inner)
    choice, means = fastest_grouped(cases)

    table = Table(title=f"LoRA linear layer, {args.rows} rows, r={args.rank}, {args.slots} slots: "
                        "ms per call (best), +% over base")
    table.add_column("hidden", justify="right")
    table.add_column("distinct", justify="right")
    for name in ["base", *VARIANTS]:
        table.add_column(name, justify="right")
    for c in cases:
        base = c["ms"]["base"]
        table.add_row(str(c["hidden"]), str(c["distinct"]), f"{base:.3f}",
                      *[f"{c['ms'][k]:.3f} ({100 * (c['ms'][k] / base - 1):+.0f}%)" for k in VARIANTS])
    console.print(table)
    console.print("geometric mean ms: " + ", ".join(f"{k} {v:.3f}" for k, v in means.items()))
    console.print(f"fastest grouped variant: [bold]{choice}[/bold]; the model uses {MODEL_CHOICE}"
                  + ("" if choice in {f"windows{w}" for w in lora.WINDOWS}
                     else " (a different one won this run)"))

    if not args.no_write:
        settings = {"rows": args.rows, "rank": args.rank, "slots": args.slots, "repeats": args.repeats,
                    "inner": args.inner, "nproc": machine_info()["nproc"]}
        result = {"machine": machine_info(), "jax": jax.__version__, "settings": settings,
                  "cases": cases, "geomean_ms": means, "fastest_grouped": choice, "model_uses": MODEL_CHOICE}
        path = write_results("lora", result)
        console.print(f"results: {path}")
        if update_readme("lora", markdown(cases, settings, choice)):
            console.print("README.md: bench:lora section updated")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
