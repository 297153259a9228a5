"""Attention's per-layer options (score scale, sliding window, logit soft-capping) as transformers'
eager attention has them (models/gemma2/modeling_gemma2.py `eager_attention_forward`,
masking_utils.py `sliding_window_overlay`): XLA's causal attention against a float64 reference
written from transformers' code, XLA's bucket attention against causal's rows, and the native
kernel against the bucket, through the backends that serve them."""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from computed.backend import native
from computed.backend.tp import TensorParallelBackend
from computed.backend.xla import XlaBackend
from computed.model import attention, kv_cache, sharding
from computed.model.kv_cache import KVCache

KV, GROUP = 2, 3  # grouped-query: query head h reads KV head h // GROUP
WINDOWS = (0, 1, 5, 16, 17, 40)
SOFTCAPS = (0.0, 50.0, 5.0)  # 5: scores of a few units, where tanh bends
MAX_LEN = 64
# decode rows: a position each (the row attends up to and including it; lengths 1 to 64, some
# shorter than the windows, some longer, in and across blocks of 16), and two inactive rows
POSITIONS = np.array([0, 2, 15, 16, 32, 39, 46, 63, 20, 0], np.int32)
ACTIVE = np.array([True] * 8 + [False, False])
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# relative to max |reference|: float32 rounding, or bfloat16's (scores, weights and outputs rounded
# to 8 bits, as transformers rounds them in a bfloat16 model)
TOLERANCE = {"float32": 1e-5, "bfloat16": 4e-2}
CASES = list(itertools.product(WINDOWS, SOFTCAPS))


def eager(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float | None, window: int,
          softcap: float) -> np.ndarray:
    """transformers' eager attention in float64 over one sequence: q [T, kv, g, d], k and v [T, kv, d]
    -> [T, heads * d]; the mask is the causal one with the sliding-window overlay where `window`."""
    t, kv, g, d = q.shape
    query = q.astype(np.float64).reshape(t, kv * g, d).transpose(1, 0, 2)  # [heads, T, d]
    key = np.repeat(k.astype(np.float64).transpose(1, 0, 2), g, axis=0)  # repeat_kv
    value = np.repeat(v.astype(np.float64).transpose(1, 0, 2), g, axis=0)
    weights = query @ key.transpose(0, 2, 1) * (d ** -0.5 if scale is None else scale)
    if softcap:
        weights = np.tanh(weights / softcap) * softcap
    q_idx, kv_idx = np.arange(t)[:, None], np.arange(t)[None, :]
    allowed = kv_idx <= q_idx  # causal_mask_function
    if window:
        allowed &= kv_idx > q_idx - window  # sliding_window_overlay
    weights = np.where(allowed, weights, -np.inf)
    weights = np.exp(weights - weights.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    out: np.ndarray = (weights @ value).transpose(1, 0, 2).reshape(t, kv * g * d)
    return out


def bf16_valued(x: np.ndarray) -> np.ndarray:
    return np.array(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32), np.float32)


def sequences(rng: np.random.Generator, rows: int, head_dim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q [rows, T, kv, g, d] (scaled so that scores reach a few units), k and v [rows, T, kv, d];
    float32 holding bfloat16 values, so that both dtypes see the same numbers."""
    q = 3 * rng.standard_normal((rows, MAX_LEN, KV, GROUP, head_dim))
    k = rng.standard_normal((rows, MAX_LEN, KV, head_dim))
    v = rng.standard_normal((rows, MAX_LEN, KV, head_dim))
    return bf16_valued(q), bf16_valued(k), bf16_valued(v)


def assert_close(got: np.ndarray, want: np.ndarray, dtype: str, what: str) -> None:
    err = np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max()
    assert err <= TOLERANCE[dtype], f"{what}: max error {err:.2e} of max |reference|, above {TOLERANCE[dtype]}"


def blocked_cache(k: np.ndarray, v: np.ndarray, layers: int = 2) -> KVCache:
    """A float32 cache with K in blocks (the attention kernel's layout, which XLA's attention reads
    too) holding sequences k and v [rows, T, kv, d] in layer 1, zeros in layer 0."""
    rows, t, kv, d = k.shape
    cache = KVCache(k=jnp.zeros((layers, rows, kv, kv_cache.blocks(t), d, kv_cache.KV_BLOCK), jnp.float32),
                    v=jnp.zeros((layers, rows, kv, t, d), jnp.float32))
    return kv_cache.write_prompts(cache, 1, jnp.arange(rows), jnp.asarray(k), jnp.asarray(v))


Step = tuple[KVCache, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def decode_step(rng: np.random.Generator, head_dim: int) -> Step:
    """A decode step's operands: the cache before it, this step's q, k and v [rows, ...] (bfloat16
    values), and the sequences the step leaves (k and v written at each active row's position)."""
    rows = len(POSITIONS)
    q_seq, k_seq, v_seq = sequences(rng, rows, head_dim)
    cache = blocked_cache(k_seq, v_seq)
    at = np.arange(rows), POSITIONS
    q = q_seq[at]
    k_new = bf16_valued(rng.standard_normal((rows, KV, head_dim)))
    v_new = bf16_valued(rng.standard_normal((rows, KV, head_dim)))
    k_seq[at[0][ACTIVE], POSITIONS[ACTIVE]] = k_new[ACTIVE]
    v_seq[at[0][ACTIVE], POSITIONS[ACTIVE]] = v_new[ACTIVE]
    return cache, q, k_new, v_new, q_seq, k_seq, v_seq


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,scale", [(32, None), (24, None), (32, 256 ** -0.5), (24, 0.3)])
def test_causal_attention_is_transformers_eager_attention(dtype: str, head_dim: int, scale: float | None) -> None:
    """Gemma's query_pre_attn_scalar**-0.5 or Granite's attention_multiplier for the scale, Mistral's and
    Gemma's sliding windows, Gemma 2's soft-capping: every window and cap, over two sequences."""
    q, k, v = sequences(np.random.default_rng(head_dim), 2, head_dim)
    for window, softcap in CASES:
        got = attention.causal(jnp.asarray(q, DTYPES[dtype]), jnp.asarray(k, DTYPES[dtype]),
                               jnp.asarray(v, DTYPES[dtype]), scale=scale, window=window, softcap=softcap)
        assert got.dtype == DTYPES[dtype]
        for b in range(2):
            assert_close(np.asarray(got[b].astype(jnp.float32)), eager(q[b], k[b], v[b], scale, window, softcap),
                         dtype, f"window {window}, softcap {softcap}, sequence {b}")


def test_the_defaults_are_todays_attention() -> None:
    """No options: head_dim**-0.5, every earlier position, no cap; a window as long as the sequence is
    no window."""
    qs, ks, vs = sequences(np.random.default_rng(1), 1, 32)
    q, k, v = jnp.asarray(qs), jnp.asarray(ks), jnp.asarray(vs)
    plain = np.asarray(attention.causal(q, k, v))
    np.testing.assert_array_equal(plain, np.asarray(attention.causal(q, k, v, scale=32 ** -0.5, window=MAX_LEN)))
    np.testing.assert_allclose(plain[0], eager(qs[0], ks[0], vs[0], None, 0, 0.0), rtol=0,
                               atol=1e-5 * np.abs(plain).max())
    with pytest.raises(ValueError, match="window -1"):
        attention.causal(q, k, v, window=-1)
    with pytest.raises(ValueError, match="softcap -2"):
        attention.causal(q, k, v, softcap=-2.0)


@pytest.mark.slow  # a decode step compiled per bucket and cache layout: out of `make test-quick`
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,scale", [(32, None), (24, 0.3)])
def test_a_decode_steps_bucket_attention_is_causal_attentions_row(dtype: str, head_dim: int,
                                                                  scale: float | None) -> None:
    """The XLA backend's decode step (attention.bucket over the cache, on either layout) gives each
    active row what causal attention over the row's sequence gives at its position."""
    cache, q, k_new, v_new, q_seq, k_seq, v_seq = decode_step(np.random.default_rng(head_dim), head_dim)
    dt = DTYPES[dtype]
    keys, _ = kv_cache.read(cache, 1, MAX_LEN)  # [rows, kv, d, T]: positions-minor K
    minor = KVCache(k=jnp.zeros((2, *keys.shape), dt).at[1].set(keys.astype(dt)), v=cache.v.astype(dt))
    caches = {"blocked": KVCache(cache.k.astype(dt), cache.v.astype(dt)), "positions-minor": minor}
    backend = XlaBackend()
    for (window, softcap), (layout, start) in itertools.product(CASES, caches.items()):
        out, after = backend.decode_attention(jnp.asarray(q, dt), jnp.asarray(k_new, dt), jnp.asarray(v_new, dt),
                                              start, 1, jnp.asarray(POSITIONS), jnp.asarray(ACTIVE), MAX_LEN,
                                              scale=scale, window=window, softcap=softcap)
        rows = np.asarray(attention.causal(jnp.asarray(q_seq, dt), jnp.asarray(k_seq, dt), jnp.asarray(v_seq, dt),
                                           scale=scale, window=window, softcap=softcap).astype(jnp.float32))
        got = np.asarray(out.astype(jnp.float32))
        for b in np.flatnonzero(ACTIVE):
            want = rows[b, POSITIONS[b]]
            if dtype == "float32":
                assert_close(got[b], want, dtype, f"{layout}, window {window}, softcap {softcap}, row {b}")
            else:  # bfloat16: one rounding of the output apart, on the causal and on the reference
                err = np.abs(got[b] - want).max() / np.abs(want).max()
                assert err <= 1e-2, f"{layout}, window {window}, softcap {softcap}, row {b}: {err:.2e}"
                assert_close(got[b], eager(q_seq[b], k_seq[b], v_seq[b], scale, window, softcap)[POSITIONS[b]],
                             dtype, f"{layout}, window {window}, softcap {softcap}, row {b} against eager")
    keys, values = kv_cache.read(after, 1, MAX_LEN)  # the step's k and v landed at the active rows' positions
    np.testing.assert_array_equal(np.asarray(jnp.swapaxes(keys, 2, 3).astype(jnp.float32)),
                                  k_seq.transpose(0, 2, 1, 3))
    np.testing.assert_array_equal(np.asarray(values.astype(jnp.float32)), v_seq.transpose(0, 2, 1, 3))


def test_the_tensor_parallel_backend_passes_the_options_on() -> None:
    """TensorParallelBackend's decode attention is XlaBackend's, options included (one device's mesh)."""
    cache, q, k_new, v_new, *_ = decode_step(np.random.default_rng(3), 32)
    args = jnp.asarray(q), jnp.asarray(k_new), jnp.asarray(v_new), cache, 1, jnp.asarray(POSITIONS), \
        jnp.asarray(ACTIVE), MAX_LEN
    want, _ = XlaBackend().decode_attention(*args, scale=0.2, window=17, softcap=5.0)
    got, _ = TensorParallelBackend(mesh=sharding.make_mesh(1)).decode_attention(*args, scale=0.2, window=17,
                                                                                softcap=5.0)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    plain, _ = XlaBackend().decode_attention(*args)
    assert np.abs(np.asarray(plain) - np.asarray(want)).max() > 0.1  # the options did something


@pytest.mark.skipif(not native.available(), reason=f"native kernels unavailable: {native.unavailable_reason()}")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,scale", [(32, None), (24, None), (32, 0.3), (24, 256 ** -0.5)])
def test_the_attention_kernel_is_the_bucket_attention(dtype: str, head_dim: int, scale: float | None) -> None:
    """NativeBackend's decode step (the kernel, each row over its own positions, skipping the blocks
    before its window) against XlaBackend's over the same blocked float32 cache: outputs to float32
    rounding, zeros for inactive rows, and the same cache after the step. A bfloat16 model's q, k and
    v arrive in bfloat16 and its cache is float32 (NativeBackend.cache_dtype)."""
    cache, q, k_new, v_new, *_ = decode_step(np.random.default_rng(head_dim + 1), head_dim)
    kernel, xla = native.NativeBackend(), XlaBackend()
    positions, active, dt = jnp.asarray(POSITIONS), jnp.asarray(ACTIVE), DTYPES[dtype]
    for window, softcap in CASES:
        want, want_cache = xla.decode_attention(jnp.asarray(q), jnp.asarray(k_new), jnp.asarray(v_new), cache, 1,
                                                positions, active, MAX_LEN, scale=scale, window=window,
                                                softcap=softcap)
        got, got_cache = kernel.decode_attention(jnp.asarray(q, dt), jnp.asarray(k_new, dt), jnp.asarray(v_new, dt),
                                                 jax.tree.map(jnp.copy, cache), 1, positions, active, MAX_LEN,
                                                 scale=scale, window=window, softcap=softcap)
        assert got.dtype == DTYPES[dtype]
        got_rows, want_rows = np.asarray(got.astype(jnp.float32)), np.asarray(want)
        for b in np.flatnonzero(ACTIVE):
            what = f"window {window}, softcap {softcap}, row {b}"
            if dtype == "float32":
                assert_close(got_rows[b], want_rows[b], dtype, what)
            else:  # float32's result rounded once to bfloat16 (half its 8-bit ulp), to float32 rounding
                bound = np.abs(want_rows[b]) * 2.0 ** -8 + 1e-5 * np.abs(want_rows[b]).max()
                assert (np.abs(got_rows[b] - want_rows[b]) <= bound).all(), what
        np.testing.assert_array_equal(got_rows[~ACTIVE], 0.0)
        np.testing.assert_array_equal(np.asarray(got_cache.k), np.asarray(want_cache.k))
        np.testing.assert_array_equal(np.asarray(got_cache.v), np.asarray(want_cache.v))


@pytest.mark.skipif(not native.available(), reason=f"native kernels unavailable: {native.unavailable_reason()}")
def test_the_kernel_reads_nothing_before_a_rows_window() -> None:
    """Positions before the window's first block are never read: NaN there changes nothing (NaN in
    the window's first block, before its start, is read and dropped)."""
    cache, q, k_new, v_new, *_ = decode_step(np.random.default_rng(5), 32)
    step = jnp.asarray(POSITIONS), jnp.asarray(ACTIVE), MAX_LEN
    args = jnp.asarray(q), jnp.asarray(k_new), jnp.asarray(v_new)
    want, _ = native.NativeBackend().decode_attention(*args, jax.tree.map(jnp.copy, cache), 1, *step, window=5,
                                                      softcap=5.0)
    k, v = np.array(cache.k), np.array(cache.v)
    for b, p in enumerate(POSITIONS):
        start = max(0, p + 1 - 5)
        k[1, b, :, :start // 16] = np.nan  # whole blocks before the window's
        v[1, b, :, :start] = np.nan
        for position in range(start // 16 * 16, start):
            k[1, b, :, position // 16, :, position % 16] = np.nan
    got, _ = native.NativeBackend().decode_attention(*args, KVCache(jnp.asarray(k), jnp.asarray(v)), 1, *step,
                                                     window=5, softcap=5.0)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
