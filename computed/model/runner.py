"""The model's host side: argument checks, the KV cache, bucket choice and ahead-of-time warm-up.

`prefill`, `decode` and `forward_full` check their arguments on the host (with messages that name
the limit) and call the jitted forward pass (computed/model/decoder.py) on the backend the
parameters were loaded for. `Runner` is the model behind the engine's `Model` interface
(computed/serving/engine.py).
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from computed.backend import select
from computed.model import kv_blocks, kv_cache, lora, scores
from computed.model.config import DecoderConfig
from computed.model.kv_blocks import KVBlocks
from computed.model.kv_cache import KV_BLOCK, KVCache
from computed.model.decoder import (
    decode_jit,
    extend_jit,
    forward_full_jit,
    prefill_jit,
    rope_tables,
)
from computed.model.params import DecoderParams
from shared.replica_protocol import TokenScores
from computed.model.warmup import compile_serving
from computed.residency.pool import LoraPool


def init_cache(config: DecoderConfig, max_batch: int, max_len: int, dtype: str | jnp.dtype = "float32", *,
               blocked: bool | None = None) -> KVCache:
    """A zeroed cache of `max_batch` rows of `max_len` positions for a model of `dtype`, as the
    backend `computed.backend.select(dtype)` attends: in its `cache_dtype` (float32 for the
    attention kernel, else the model's), K blocked for the attention kernel or positions-minor
    for XLA's attention (KVCache), unless `blocked` says."""
    backend = select(dtype)
    if blocked is None:
        blocked = backend.blocked
    return kv_cache.zeros(config, max_batch, max_len, backend.cache_dtype(dtype), blocked=blocked)


def _host_i32(x: Any, name: str) -> np.ndarray:
    """A host int32 array: Python ints, numpy ints and int32 arrays all trace alike (no recompile)."""
    arr = np.asarray(x)
    if arr.dtype.kind not in "iu" and arr.dtype != np.bool_:
        raise TypeError(f"{name} must be integers, got {arr.dtype}")
    return arr.astype(np.int32)


def _check_tokens(tokens: np.ndarray, config: DecoderConfig) -> None:
    if tokens.size and not (0 <= tokens.min() and tokens.max() < config.vocab_size):
        raise ValueError(f"token ids must be in [0, {config.vocab_size}) (vocab_size); "
                         f"got {tokens.min()}..{tokens.max()}")


def _check_slots(slots: np.ndarray, lora_pool: LoraPool | None) -> None:
    limit = 0 if lora_pool is None else int(lora_pool.scaling.shape[0])
    bad = slots[(slots < lora.BASE) | (slots >= limit)]
    if bad.size:
        raise ValueError(f"slot {int(bad[0])} is outside [-1, {limit}): -1 is the base model"
                         + ("; no LoRA pool was given" if lora_pool is None else
                            f", the pool has {limit} slots (max_loras)"))


def _check_pool(pool: LoraPool | None, config: DecoderConfig) -> None:
    if pool is None:
        return
    dims = config.module_dims
    for m, a in pool.A.items():
        n_in, n_out = dims[m]
        b = pool.B[m]
        if a.shape[0] != config.num_layers or a.shape[-1] != n_in or b.shape[-2] != n_out:
            raise ValueError(f"the LoRA pool's {m} has A {a.shape} and B {b.shape}; the model needs "
                             f"[{config.num_layers}, slots, rank, {n_in}] and "
                             f"[{config.num_layers}, slots, {n_out}, rank]: configure the pool for this model")


def prefill(params: DecoderParams, lora_pool: LoraPool | None, cache: KVCache, tokens: Any, length: int,
            row: int, slot: int) -> tuple[np.ndarray, KVCache]:
    """Run one prompt (`tokens [P]`, the first `length` real, the rest padding) into cache row `row`:
    `prefill_batch` with one prompt. Returns (logits [vocab] float32 after token length - 1, the
    updated cache); `cache` is donated. `slot` is the request's LoRA slot, or -1 for the base model."""
    tokens = _host_i32(tokens, "tokens")
    if tokens.ndim != 1:
        raise ValueError(f"prefill takes tokens [P]; got shape {tokens.shape}")
    logits, cache = prefill_batch(params, lora_pool, cache, tokens[None], [length], [row], [slot])
    return logits[0], cache


def prefill_batch(params: DecoderParams, lora_pool: LoraPool | None, cache: KVCache, tokens: Any, lengths: Any,
                  rows: Any, slots: Any, *, pad_to: int | None = None,
                  starts: Any = None) -> tuple[np.ndarray, KVCache]:
    """`prefill_hidden` without the hidden states."""
    logits, _, cache = prefill_hidden(params, lora_pool, cache, tokens, lengths, rows, slots, pad_to=pad_to,
                                      starts=starts)
    return logits, cache


def prefill_hidden(params: DecoderParams, lora_pool: LoraPool | None, cache: KVCache, tokens: Any, lengths: Any,
                   rows: Any, slots: Any, *, pad_to: int | None = None,
                   starts: Any = None) -> tuple[np.ndarray, jax.Array, KVCache]:
    """Run n prompts (`tokens [n, P]`, prompt i's first `lengths[i]` real, the rest padding) at once,
    prompt i into cache row `rows[i]` (distinct rows) with LoRA slot `slots[i]` (-1: the base model).

    Returns (logits [n, vocab] float32 on the host, prompt i's after its token lengths[i] - 1,
    the final normed hidden states [n', P, hidden] of every position (on the device, n' >= n),
    the updated cache); `cache` is donated. One compile per (n, P): bucket both. `pad_to` runs the forward over
    that many prompts (copies of prompt 0, which write what it writes), so that any n up to it
    shares one compile.

    `starts [n]` (multiples of 16, start + P at most max_len) continues rows that hold KV up to
    there instead, prompt i's tokens at positions from starts[i] (`extend_jit`: a prefix-cache
    hit's rest, a long prompt's later chunks); one compile per (n, P) again."""
    tokens = _host_i32(tokens, "tokens")
    if tokens.ndim != 2 or tokens.shape[0] < 1 or not 1 <= tokens.shape[1] <= cache.max_len:
        raise ValueError(f"prefill takes tokens [n, P] with n >= 1 and 1 <= P <= the cache's max_len "
                         f"{cache.max_len}; got shape {tokens.shape}")
    n, p = tokens.shape
    _check_tokens(tokens, params.config)
    lengths_, rows_, slots_ = (_host_i32(v, name).reshape(-1)
                               for v, name in ((lengths, "lengths"), (rows, "rows"), (slots, "slots")))
    for name, arr in (("lengths", lengths_), ("rows", rows_), ("slots", slots_)):
        if arr.shape != (n,):
            raise ValueError(f"prefill takes {name} of shape [{n}] (one per prompt); got {arr.shape}")
    bad = lengths_[(lengths_ < 1) | (lengths_ > p)]
    if bad.size:
        raise ValueError(f"length {int(bad[0])} must be in [1, {p}] (the padded prompts' length)")
    bad = rows_[(rows_ < 0) | (rows_ >= cache.max_batch)]
    if bad.size:
        raise ValueError(f"row {int(bad[0])} is outside the cache's {cache.max_batch} rows (max_batch)")
    if len(set(rows_.tolist())) != n:
        raise ValueError(f"rows {rows_.tolist()} name a row twice: each prompt needs its own cache row")
    _check_slots(slots_, lora_pool)
    _check_pool(lora_pool, params.config)
    starts_ = None if starts is None else _host_i32(starts, "starts").reshape(-1)
    if starts_ is not None:
        bad = starts_[(starts_ % KV_BLOCK != 0) | (starts_ < 0) | (starts_ + p > cache.max_len)]
        if starts_.shape != (n,) or bad.size:
            raise ValueError(f"starts must be [{n}] multiples of {KV_BLOCK} with start + {p} at most the "
                             f"cache's max_len {cache.max_len}; got {starts_.tolist()}")
    if pad_to is not None:
        if pad_to < n:
            raise ValueError(f"pad_to {pad_to} is below the {n} prompts")
        extra = pad_to - n
        tokens = np.concatenate([tokens, np.repeat(tokens[:1], extra, 0)])
        lengths_, rows_, slots_ = (np.concatenate([a, np.repeat(a[:1], extra)]) for a in (lengths_, rows_, slots_))
        if starts_ is not None:
            starts_ = np.concatenate([starts_, np.repeat(starts_[:1], extra)])
    if starts_ is not None:
        logits, hidden, cache = extend_jit(params, lora_pool, cache, tokens, starts_, lengths_, rows_, slots_)
    else:
        logits, hidden, cache = prefill_jit(params, lora_pool, cache, tokens, lengths_, rows_, slots_)
    return np.asarray(logits)[:n], hidden, cache  # sliced on the host: a slice of a jax.Array compiles


def decode(params: DecoderParams, lora_pool: LoraPool | None, cache: KVCache, tokens: Any, positions: Any,
           slots: Any, active: Any, attend_len: int | None = None, *,
           window: int | None = None, rows: Any = None) -> tuple[jax.Array, KVCache]:
    """One decode step for every cache row: each argument `[max_batch]`. Returns (logits [B, vocab] f32, cache).

    Row b appends `tokens[b]` at `positions[b]` (< max_len) and attends to
    [0, positions[b]] with LoRA slot `slots[b]` (-1: base). Rows with
    `active[b]` False write nothing to the cache and their other entries are
    ignored. `cache` is donated. A bucket attention reads the first `attend_len`
    positions of every row (one compile per length; the attention kernel reads each
    row's own and one compile serves every length). `window` is the LoRA window where
    the backend has them (the XLA backend's window loop, one compile per size): by
    default the backend picks one for this mix (`params.backend.window`).

    `rows [n]` runs the step over n entries instead, entry i for cache row rows[i] (each argument
    then `[n]`; an inactive entry's row may be max_batch, padding): the projections cost what n
    rows cost. One compile per n (`Runner` takes n from `backend.decode_rows`).
    """
    tokens, positions, slots = (_host_i32(tokens, "tokens"), _host_i32(positions, "positions"),
                                _host_i32(slots, "slots"))
    active = np.asarray(active, np.bool_)
    b, what = cache.max_batch, "the cache's max_batch"
    if rows is not None:
        rows = _host_i32(rows, "rows")
        if rows.ndim != 1:
            raise ValueError(f"rows must be [n], one cache row per entry; got shape {rows.shape}")
        b, what = rows.shape[0], "one per entry of rows"
    named = [("tokens", tokens), ("positions", positions), ("slots", slots), ("active", active)]
    for name, arr in named + ([] if rows is None else [("rows", rows)]):
        if arr.shape != (b,):
            raise ValueError(f"decode takes {name} of shape [{b}] ({what}); got {arr.shape}")
    if rows is not None:
        taken = rows[active]
        if taken.size != len(set(taken.tolist())) or \
                (taken.size and not (0 <= taken.min() and taken.max() < cache.max_batch)):
            raise ValueError(f"rows must name distinct cache rows in [0, {cache.max_batch}) for the active "
                             f"entries; got {rows.tolist()}")
    live = positions[active]
    if live.size and not (0 <= live.min() and live.max() < cache.max_len):
        raise ValueError(f"active rows need positions in [0, {cache.max_len}) (the cache's max_len); "
                         f"got {live.min()}..{live.max()}")
    _check_tokens(tokens[active], params.config)
    tokens = np.where(active, tokens, 0).astype(np.int32)
    slots = np.where(active, slots, lora.BASE).astype(np.int32)  # inactive rows compute no LoRA term
    _check_slots(slots, lora_pool)
    _check_pool(lora_pool, params.config)
    positions = np.where(active, positions, 0).astype(np.int32)
    if attend_len is None:
        attend_len = cache.max_len
    if not (live.size == 0 or live.max() < attend_len <= cache.max_len):
        raise ValueError(f"attend_len {attend_len} must exceed every active position and be at "
                         f"most the cache's max_len {cache.max_len}")
    backend = params.backend
    backend.check_cache(cache)
    # no pool: no window, one compile whatever the caller passed
    window = None if lora_pool is None else backend.window(slots, window)
    out: tuple[jax.Array, KVCache] = decode_jit(
        params, lora_pool, cache, tokens, positions, slots, active,
        rope_tables(positions, params.config),
        attend_len=backend.attend_len(cache, attend_len), window=window, rows=rows)
    return out


def forward_full(params: DecoderParams, lora_pool: LoraPool | None, tokens: Any, slots: Any) -> jax.Array:
    """Logits [B, T, vocab] float32 for `tokens [B, T]`, row b with LoRA slot `slots[b]`; no cache."""
    tokens, slots = _host_i32(tokens, "tokens"), _host_i32(slots, "slots")
    if tokens.ndim != 2 or slots.shape != tokens.shape[:1]:
        raise ValueError(f"forward_full takes tokens [B, T] and slots [B]; got {tokens.shape} and {slots.shape}")
    _check_tokens(tokens, params.config)
    _check_slots(slots, lora_pool)
    _check_pool(lora_pool, params.config)
    logits: jax.Array = forward_full_jit(params, lora_pool, tokens, slots)
    return logits


PREFILL_TOKENS = 256  # tokens one prefill forward takes at most (Runner's prefill_tokens): docs/benchmarks.md


def _binary_parts(n: int) -> list[int]:
    """`n` as a sum of distinct powers of two, largest first (12: [8, 4])."""
    return [1 << i for i in range(n.bit_length() - 1, -1, -1) if n >> i & 1]


def _powers_of_two(low: int, high: int) -> tuple[int, ...]:
    """low, 2 low, 4 low, ... below `high`, then `high`."""
    out, b = [], low
    while b < high:
        out.append(b)
        b *= 2
    return tuple(out) + (high,)


class Runner:
    """The decoder (computed/model/decoder.py) behind the engine's `Model` interface.

    `prefill` takes every prompt the engine admitted in a step at once: prompts are grouped by
    their power-of-two length bucket (from 16 up to max_len) and each group runs as forwards of
    n prompts, n * P at most `prefill_tokens` (or one prompt, where a single one is longer) and n
    a power of two up to max_batch: a group that is not splits into them (12 prompts: 8, then 4;
    padding them to 16 cost a third more). So prefill compiles once per (n, P) of
    `prefill_shapes`, whatever the prompts' adapters. A decode step runs over the smallest of
    `backend.decode_rows(max_batch)` that holds its active rows (the native backend: quarters of
    max_batch; the others: max_batch). With the native backend decode compiles once per such
    count: each row attends over its own positions and the LoRA kernel takes any mix. With the
    XLA backend a decode step attends over the bucket that holds its longest sequence, and
    decode compiles once per bucket and LoRA window (`backend.windows(max_batch)`; each step's
    mix picks its window). `warmup` compiles them all up front, so nothing compiles while
    serving.
    """

    def __init__(self, config: Any, params: DecoderParams, *, max_batch: int, max_len: int,
                 prefill_tokens: int = PREFILL_TOKENS, extend: bool = False, piece: int = 0) -> None:
        self.config, self.params = config, params
        self.vocab_size = int(config.vocab_size)
        self.max_batch = max_batch
        self.max_len = max_len
        self.buckets = _powers_of_two(16, max_len) if max_len > 16 else (max_len,)
        self.row_buckets = _powers_of_two(1, max_batch)
        self.decode_rows = params.backend.decode_rows(max_batch)
        self.prefill_tokens = prefill_tokens
        # prefills that continue a row (prefix-cache hits, chunks): compiled at warm-up; not
        # with dynamic RoPE, whose tables depend on each forward's whole length
        self.extend = extend and self.chunkable(config)
        # the longest piece of a prompt one forward takes (the engine's --prefill-chunk; 0: whole
        # prompts): warm-up compiles no bucket above it
        self.piece = piece if piece and self.extend else max_len
        # while a warm-up that let the replica serve early compiles the rest: the forwards
        # ("prefill" | "extend", prompts, length; "decode", rows, 0; "blocks", count, 0) compiled so
        # far, which alone `prefill`, `decode` and the block copies run; None: any (all compiled, or no warm-up: each compiles on
        # first use)
        self.compiled: frozenset[tuple[str, int, int]] | None = None

    @staticmethod
    def chunkable(config: DecoderConfig) -> bool:
        """Whether a prompt of this model can be prefilled in chunks (not with dynamic RoPE)."""
        return not any(r.type == "dynamic" for r in config.ropes)

    def bucket(self, length: int) -> int:
        return next(b for b in self.buckets if b >= length)

    def prefill_rows(self, length: int) -> int:
        """The most prompts of padded length `length` one prefill forward takes."""
        return max([n for n in self.row_buckets if n * length <= self.prefill_tokens], default=1)

    @property
    def prefill_shapes(self) -> tuple[tuple[int, int], ...]:
        """Every (prompts, padded length) `prefill` runs a forward of: lengths up to the bucket of
        the longest piece (chunks of 256 never run a bucket above 256)."""
        top = self.bucket(min(self.piece, self.max_len))
        return tuple((n, p) for p in self.buckets if p <= top for n in self.row_buckets if n <= self.prefill_rows(p))

    def new_cache(self, blocked: bool | None = None) -> KVCache:
        """A zeroed KV cache for this runner; K's layout as the backend attends, or by `blocked`."""
        if blocked is None:
            blocked = self.params.backend.blocked
        backend = self.params.backend
        return backend.shard_cache(kv_cache.zeros(self.config, self.max_batch, self.max_len,
                                                  backend.cache_dtype(self.params.dtype), blocked=blocked))

    def prefill(self, pool: LoraPool | None, cache: KVCache, prompts: Sequence[Sequence[int] | np.ndarray],
                rows: Sequence[int] | np.ndarray, slots: Sequence[int] | np.ndarray,
                starts: Sequence[int] | None = None,
                hidden: dict[int, np.ndarray] | None = None) -> tuple[np.ndarray, KVCache]:
        """Prompt i into cache row rows[i] with LoRA slot slots[i] (-1: base), all at once as
        `prefill_shapes` allow. Returns (logits [n, vocab] float32, prompt i's after its last
        token, the updated cache); `cache` is donated.

        `starts[i]` (a multiple of 16; needs `extend`): row rows[i] holds prompt i's KV up to
        there already (a prefix-cache hit, earlier chunks), and only its tokens from there on
        are computed; `prompts[i]` still holds the whole prompt up to the chunk's end. A chunk
        whose bucket would run past max_len starts earlier instead (recomputing KV the row
        holds).

        `hidden`: for each prompt index it holds on the call, filled with the final normed hidden
        states `[len(prompts[i]) - starts[i], hidden]` of the positions computed for it (for its
        prompt logprobs, `score`); the prompts not in it cost nothing more."""
        if not len(prompts) == len(rows) == len(slots) == (len(prompts) if starts is None else len(starts)):
            raise ValueError(f"prefill takes one row, slot and start per prompt; got {len(prompts)} prompts, "
                             f"{len(rows)} rows and {len(slots)} slots")
        lengths = [len(t) for t in prompts]
        if not all(1 <= n <= self.max_len for n in lengths):
            raise ValueError(f"prompts must hold 1 to max_len {self.max_len} tokens; got lengths {lengths}")
        if starts is not None and any(starts) and not self.extend:
            raise ValueError("this runner was not built for prefill chunks (extend=False)")
        firsts = [self._chunk_start(n, 0 if starts is None else starts[i]) for i, n in enumerate(lengths)]
        groups: dict[tuple[int, bool], list[int]] = {}
        for i, n in enumerate(lengths):
            groups.setdefault((self.bucket(n - firsts[i]), firsts[i] > 0), []).append(i)
        out = np.zeros((len(prompts), self.vocab_size), np.float32)
        for (p, later), members in groups.items():
            most = self.prefill_rows(p)
            for begin in range(0, len(members), most):
                part = members[begin:begin + most]
                tokens = np.zeros((len(part), p), np.int32)
                for j, i in enumerate(part):
                    tokens[j, :lengths[i] - firsts[i]] = np.asarray(prompts[i])[firsts[i]:]
                # forwards of power-of-two counts (12 prompts: 8 then 4), not one padded to the
                # next (16): a forward costs about its tokens, padding included
                at = 0
                for size in self._counts(len(part), "extend" if later else "prefill", p):
                    chunk = part[at:at + size]
                    logits, states, cache = prefill_hidden(
                        self.params, pool, cache, tokens[at:at + size], [lengths[i] - firsts[i] for i in chunk],
                        [rows[i] for i in chunk], [slots[i] for i in chunk],
                        starts=[firsts[i] for i in chunk] if later else None)
                    out[chunk] = logits
                    asked = [j for j, i in enumerate(chunk) if hidden is not None and i in hidden]
                    if asked and hidden is not None:
                        host = np.asarray(states)  # to the host only when a prompt asked
                        for j in asked:
                            i = chunk[j]
                            begin = (0 if starts is None else starts[i]) - firsts[i]
                            hidden[i] = host[j, begin:lengths[i] - firsts[i]]
                    at += size
        return out, cache

    def score(self, hidden: np.ndarray, targets: Sequence[int], k: int) -> list[TokenScores]:
        """The logprob of `targets[i]` after hidden state `hidden[i]` (from `prefill`'s `hidden`)
        and its position's top `k` (computed/model/scores.py)."""
        return scores.prompt_scores(self.params, hidden, np.asarray(targets, np.int32), k)

    def _counts(self, n: int, kind: str, p: int) -> list[int]:
        """The prompt counts of the forwards that run `n` prompts of bucket `p`: n itself where it
        is a row bucket, else its binary parts; while a warm-up still compiles (`compiled`), the
        largest counts compiled so far (one prompt's always are)."""
        done = self.compiled
        if done is None:
            return [n] if n in self.row_buckets else _binary_parts(n)
        have = sorted((m for k, m, q in done if k == kind and q == p), reverse=True) or [1]
        out = []
        while n:
            out.append(next((m for m in have if m <= n), 1))
            n -= out[-1]
        return out

    def _chunk_start(self, length: int, start: int) -> int:
        """Where a chunk of a `length`-token prompt from `start` begins: `start`, or earlier where
        its bucket would run past max_len."""
        if start % KV_BLOCK or not 0 <= start < length:
            raise ValueError(f"a chunk starts at a multiple of {KV_BLOCK} before the prompt's end {length}; "
                             f"got {start}")
        while start and start + self.bucket(length - start) > self.max_len:
            start = max(0, (self.max_len - self.bucket(length - start)) // KV_BLOCK * KV_BLOCK)
        return start

    # ---- the prefix cache's blocks (computed/model/kv_blocks.py) ----------------------

    @property
    def block_counts(self) -> tuple[int, ...]:
        """The block counts the copies between rows and the store compile for."""
        return _powers_of_two(1, max(1, self.max_len // KV_BLOCK))

    def block_bytes(self) -> int:
        return kv_blocks.block_bytes(self.config, self.params.backend.cache_dtype(self.params.dtype))

    def cache_bytes(self) -> int:
        """Bytes of the running rows' KV cache (max_batch x max_len positions)."""
        return self.max_batch * kv_cache.blocks(self.max_len) * self.block_bytes()

    def new_blocks(self, n: int) -> KVBlocks:
        backend = self.params.backend
        return backend.shard_blocks(kv_blocks.zeros(self.config, n, backend.cache_dtype(self.params.dtype)))

    def _padded(self, ids: Sequence[int], fill: int) -> np.ndarray:
        """`ids` padded to the smallest block count compiled (while a warm-up still compiles
        them, `compiled`: the largest is)."""
        done = self.compiled
        m = next(b for b in self.block_counts if b >= len(ids) and (done is None or ("blocks", b, 0) in done
                                                                     or b == self.block_counts[-1]))
        out = np.full(m, fill, np.int32)
        out[:len(ids)] = ids
        return out

    def load_blocks(self, cache: KVCache, store: KVBlocks, row: int, ids: Sequence[int]) -> KVCache:
        """Store blocks `ids` into row `row`'s first len(ids) blocks; `cache` is donated."""
        out: KVCache = kv_blocks.load_row(cache, store, np.int32(row), self._padded(ids, 0))
        return out

    def save_blocks(self, store: KVBlocks, cache: KVCache, row: int, src: Sequence[int],
                    dst: Sequence[int]) -> KVBlocks:
        """Row `row`'s blocks `src` into store blocks `dst`; `store` is donated."""
        out: KVBlocks = kv_blocks.save_row(store, cache, np.int32(row), self._padded(src, 0),
                                           self._padded(dst, store.size))
        return out

    def copy_row(self, cache: KVCache, src: int, dst: int) -> KVCache:
        """Row `src`'s KV into row `dst` (a request's choices share its prefill); `cache` is donated."""
        if not (0 <= src < self.max_batch and 0 <= dst < self.max_batch) or src == dst:
            raise ValueError(f"copy_row takes two distinct rows in [0, {self.max_batch}); got {src} and {dst}")
        out: KVCache = kv_cache.copy_row(cache, np.int32(src), np.int32(dst))
        return out

    def decode(self, pool: LoraPool, cache: KVCache, tokens: np.ndarray, positions: np.ndarray,
               slots: np.ndarray, active: np.ndarray) -> tuple[np.ndarray, KVCache]:
        """One step of the active rows; arguments `[max_batch]`, logits `[max_batch, vocab]` (an
        inactive row's are zero). It runs over the smallest of `backend.decode_rows` that holds the
        active rows, so a step of few rows costs what few rows cost (docs/kernels.md)."""
        # attention over the smallest bucket that holds every running sequence
        longest = int(positions[active].max()) + 1 if active.any() else 1
        live = np.flatnonzero(active)
        done = self.compiled
        n = next((k for k in self.decode_rows if k >= live.size and (done is None or ("decode", k, 0) in done)),
                 self.max_batch)
        if n >= self.max_batch:
            logits, cache = decode(self.params, pool, cache, tokens, positions, slots, active,
                                   attend_len=self.bucket(longest))
            return np.asarray(logits), cache
        rows = np.full(n, self.max_batch, np.int32)
        rows[:live.size] = live

        def packed(x: np.ndarray) -> np.ndarray:
            out = np.zeros(n, x.dtype)
            out[:live.size] = x[live]
            return out
        part, cache = decode(self.params, pool, cache, packed(tokens), packed(positions), packed(slots),
                             packed(active), attend_len=self.bucket(longest), rows=rows)
        every = np.zeros((self.max_batch, self.vocab_size), np.float32)
        every[live] = np.asarray(part)[:live.size]
        return every, cache

    def warmup(self, pool: LoraPool, cache: KVCache, *, store: KVBlocks | None = None,
               stop: Callable[[], bool] = lambda: False, ready: Callable[[], None] | None = None) -> None:
        """Compile prefill for every shape of `prefill_shapes` (and its chunks' where `extend`),
        decode for every bucket and LoRA window, and the prefix cache's copies where there is a
        `store`; only the shapes of `pool`, `cache` and `store` are used. `stop()` true ends it
        between two compiles. With `ready`, it is called once one prompt's forwards are compiled
        (computed/model/warmup.py): from then on `prefill` runs what is compiled while the
        forwards of several prompts follow."""
        _check_pool(pool, self.params.config)
        if ready is not None:
            self.compiled = frozenset()

        lock = threading.Lock()  # the warm-up's compile threads report one at a time

        def compiled(kind: str, n: int, p: int) -> None:
            with lock:
                if self.compiled is not None:
                    self.compiled = self.compiled | {(kind, n, p)}  # replaced whole: the serving thread reads it
        compile_serving(self.params, pool, cache, prefill_shapes=self.prefill_shapes,
                        attend_lens=self.buckets, extend_shapes=self.prefill_shapes if self.extend else (),
                        store=store, block_counts=self.block_counts, stop=stop, ready=ready, compiled=compiled)
        if not stop():
            self.compiled = None
