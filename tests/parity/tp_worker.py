"""One replica's model on N forced host devices (`python -m tests.parity.tp_worker N ASSETS OUT`):
what tests/parity/test_tensor_parallel.py compares across N, written to OUT (.npz + .json).

Run in its own process, since JAX fixes the device count when it starts: the caller sets
XLA_FLAGS=--xla_force_host_platform_device_count=N. N = 1 is today's single-device replica (the
XLA backend); N > 1 the tensor-parallel one (computed/backend/tp.py).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np

from computed.model import lora
from computed.backend import XlaBackend
from computed.model import sharding
from computed.model.loader import load_model
from computed.model.runner import Runner, forward_full
from computed.residency.pool import MemoryPool, PoolSpec
from testkit.jaxcount import counting_compiles
from tests.helpers import adapter_weights

ADAPTERS = ("rslora-all-r8", "attn-r4")  # tests/parity/test_model_parity.py OTHER_ADAPTERS
NEW_TOKENS = 8
MAX_BATCH, MAX_LEN = 4, 32  # the longest prompt (17) and its 8 tokens fit: buckets 16 and 32


def prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(11)
    return [[int(t) for t in rng.integers(0, vocab, n)] for n in (5, 9, 17, 3)]


def greedy(runner: Runner, pool: MemoryPool, batch: list[list[int]], slots: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Every prompt prefilled at once, then NEW_TOKENS - 1 decode steps together: tokens
    [NEW_TOKENS, n] and the logits [NEW_TOKENS, n, vocab] each was chosen from."""
    n = len(batch)
    cache = runner.new_cache()
    logits, cache = runner.prefill(pool.arrays, cache, batch, list(range(n)), slots)
    steps, toks = [logits], [logits.argmax(-1)]
    active = np.arange(MAX_BATCH) < n
    pos = np.zeros(MAX_BATCH, np.int32)
    pos[:n] = [len(p) for p in batch]
    slot_rows = np.full(MAX_BATCH, lora.BASE, np.int32)
    slot_rows[:n] = slots
    for step in range(NEW_TOKENS - 1):
        tokens = np.zeros(MAX_BATCH, np.int32)
        tokens[:n] = toks[-1]
        logits, cache = runner.decode(pool.arrays, cache, tokens, pos + step, slot_rows, active)
        steps.append(logits[:n])
        toks.append(logits[:n].argmax(-1))
    return np.stack(toks), np.stack(steps)


def greedy_in_chunks(runner: Runner, pool: MemoryPool, batch: list[list[int]], slots: list[int],
                     store: Any) -> tuple[np.ndarray, Any]:
    """`greedy`'s tokens with every prompt prefilled 16 tokens at a time (the later chunks
    continuing their rows), then the longest prompt once more from its first block copied
    through the prefix cache's store into a fresh cache: tokens [NEW_TOKENS, n + 1] (the last
    column that prompt's) and the store."""
    n = len(batch)
    cache = runner.new_cache()
    first = np.zeros((n, runner.vocab_size), np.float32)
    for start in range(0, max(len(p) for p in batch), 16):
        live = [i for i in range(n) if start < len(batch[i])]
        logits, cache = runner.prefill(pool.arrays, cache, [batch[i][:start + 16] for i in live], live,
                                       [slots[i] for i in live], starts=[start] * len(live))
        first[live] = logits
    longest = max(range(n), key=lambda i: len(batch[i]))
    store = runner.save_blocks(store, cache, longest, [0], [3])
    fresh = runner.load_blocks(runner.new_cache(), store, n, [3])
    again, fresh = runner.prefill(pool.arrays, fresh, [batch[longest]], [n], [slots[longest]], starts=[16])
    toks = [np.concatenate([first.argmax(-1), again.argmax(-1)])]
    rows = n + 1
    active = np.arange(MAX_BATCH) < rows
    pos = np.zeros(MAX_BATCH, np.int32)
    pos[:rows] = [len(p) for p in batch] + [len(batch[longest])]
    slot_rows = np.full(MAX_BATCH, lora.BASE, np.int32)
    slot_rows[:rows] = list(slots) + [slots[longest]]
    # rows 0..n-1 decode from `cache`, row n from `fresh`: two caches, one step each
    for step in range(NEW_TOKENS - 1):
        tokens = np.zeros(MAX_BATCH, np.int32)
        tokens[:rows] = toks[-1]
        logits, cache = runner.decode(pool.arrays, cache, tokens, pos + step, slot_rows, active & (np.arange(MAX_BATCH) < n))
        more, fresh = runner.decode(pool.arrays, fresh, tokens, pos + step, slot_rows, np.arange(MAX_BATCH) == n)
        toks.append(np.concatenate([logits[:n].argmax(-1), more[n:n + 1].argmax(-1)]))
    return np.stack(toks), store


def shard_report(tree: Any, n: int) -> list[str]:
    """Arrays whose shards on some device are not exactly 1/n (split) or whole (replicated)."""
    bad = []
    for path, a in jax.tree_util.tree_leaves_with_path(tree):
        spec = tuple(a.sharding.spec) if hasattr(a.sharding, "spec") else ()
        want = list(a.shape)
        for axis, name in enumerate(spec):
            if name is not None:
                want[axis] //= n
        shards = a.addressable_shards
        if len(shards) != n or any(list(s.data.shape) != want or s.data.nbytes * (a.size // max(1, int(np.prod(want))))
                                   != a.nbytes for s in shards):
            bad.append(f"{jax.tree_util.keystr(path)} {a.shape} {spec}: "
                       f"{[tuple(s.data.shape) for s in shards]}")
    return bad


def pointers(pool: MemoryPool) -> list[int]:
    return [s.data.unsafe_buffer_pointer() for a in jax.tree.leaves(pool.arrays) for s in a.addressable_shards]


def main(n: int, root: Path, out: Path) -> None:
    """`root` as make_example wrote it: root/model, root/adapters/<name> in `ADAPTERS` order."""
    adapter_dirs = [root / "adapters" / a for a in ADAPTERS]
    if n == 1:
        config, params = load_model(root / "model", backend=XlaBackend())
    else:
        config, params = load_model(root / "model", tensor_parallel=n)
    assert len(jax.devices()) == n, f"XLA_FLAGS gave {len(jax.devices())} devices, not {n}"
    # the drill test's replicas init the same pool (4 slots, rank 32): they warm up from the JAX cache
    spec = PoolSpec(num_layers=config.num_layers, module_dims=config.module_dims,
                    slots=len(adapter_dirs) + 2, max_rank=32, dtype="float32")
    mesh = getattr(params.backend, "mesh", None)
    pool = MemoryPool(spec, shardings=None if mesh is None else sharding.pool_shardings(spec, mesh))
    for i, d in enumerate(adapter_dirs):
        pool.write_slot(i + 1, adapter_weights(d, i + 1))  # slot 0 stays empty
    names = list(ADAPTERS)
    slot_of = {None: lora.BASE, **{a: i + 1 for i, a in enumerate(names)}}
    mixed: list[str | None] = [None, *names, names[0]][:MAX_BATCH]
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, config.vocab_size, (len(mixed), 11))
    # chunks and the prefix cache's store on N = 2 (their compiles double the worker's time;
    # N = 4 runs the same code on a wider mesh)
    chunks = n == 2
    runner = Runner(config, params, max_batch=MAX_BATCH, max_len=MAX_LEN, extend=chunks)
    batch = prompts(config.vocab_size)[:len(mixed)]
    store = runner.new_blocks(4) if chunks else None
    if n > 1:  # as a replica does before it serves; N = 1 is the reference run, whose compiles after
        # warm-up no test counts: it compiles only the shapes it runs
        runner.warmup(pool.shapes(), runner.new_cache(), store=store)
    with counting_compiles() as serving:
        mixed_tokens, mixed_logits = greedy(runner, pool, batch, [slot_of[a] for a in mixed])
        # the same prompts in chunks, and one from the prefix cache's store (3 of 4 rows: a
        # fourth row for the store's copy)
        chunk_tokens = np.zeros((0,))
        if store is not None:
            chunk_tokens, store = greedy_in_chunks(runner, pool, batch[:3], [slot_of[a] for a in mixed[:3]], store)
    singles = [greedy(runner, pool, [batch[i]], [slot_of[a]]) for i, a in enumerate(mixed)]
    result: dict[str, Any] = {"n": n, "mixed": [a for a in mixed], "pool_digest": pool.digest(),
                              "compiles_after_warmup": len(serving)}
    # a slot write after warm-up: no compile, in place on every device, no other slot moved
    pool.clear_slot(0)
    pool.write_slot(0, adapter_weights(adapter_dirs[0], 9))
    jax.block_until_ready(pool.arrays)
    others = [pool.slot_digest(s) for s in range(1, spec.slots)]
    before = pointers(pool)
    with counting_compiles() as seen:
        pool.write_slot(spec.slots - 1, adapter_weights(adapter_dirs[1], 9))
        pool.clear_slot(0)
        jax.block_until_ready(pool.arrays)
    result["write"] = {"compiles": len(seen), "in_place": pointers(pool) == before,
                       "others_unchanged": [pool.slot_digest(s) for s in range(1, spec.slots - 1)] == others[:-1]}
    result["bad_shards"] = (shard_report(params, n) + shard_report(pool.arrays, n) + shard_report(runner.new_cache(), n)
                            + ([] if store is None else shard_report(store, n)))
    result["bytes"] = {"weights": sharding.device_bytes(params), "pool": sharding.device_bytes(pool.arrays),
                       "weights_formula": sharding.expected_param_bytes(params, n),
                       "pool_formula": sharding.expected_pool_bytes(spec, n, 4)}
    np.savez(out.with_suffix(".npz"), forward=np.asarray(forward_full(params, pool.arrays, tokens,
                                                                     [slot_of[a] for a in mixed])),
             tokens=tokens, mixed_tokens=mixed_tokens, mixed_logits=mixed_logits, chunk_tokens=chunk_tokens,
             single_tokens=np.stack([t[:, 0] for t, _ in singles]),
             single_logits=np.stack([lg[:, 0] for _, lg in singles]))
    out.with_suffix(".json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(int(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
