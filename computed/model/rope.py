"""RoPE frequencies and cos/sin tables, computed as transformers 5 computes them.

Every step that transformers takes in float32 (its `torch.float` tensors) is taken here in float32,
in the same order, so the frequencies agree to the bit except where torch's float32 `pow` is off by
one unit in the last place (it is within one ulp; here a power is rounded once from float64, which
is what XLA's float32 power gives on the CPU as well).

`dynamic` (NTK) rope has no fixed frequencies: transformers recomputes them from the length of
what it is running (`dynamic_rope_update`: seq_len = max(position_ids) + 1, frequencies for
max(seq_len, max_position_embeddings)). A replica runs many sequences in one batch, so
`rope_tables` takes each row's seq_len (`seq_lens`) and gives every row the frequencies that a
transformers generation of that sequence alone uses: prefill of a prompt of P tokens,
seq_len = P; the decode step at position p, seq_len = p + 1. (transformers keeps the largest
seq_len seen until a forward shorter than max_position_embeddings resets it; for one sequence
generated from the start that is the same thing.)
"""
from __future__ import annotations

import functools
import math
from typing import Any

import jax.numpy as jnp
import numpy as np

from shared.rope import Rope

F32 = np.float32


def _pow(base: Any, exponent: Any, xp: Any) -> Any:
    """`base ** exponent` rounded once to float32 (on the host, through float64; in the graph,
    XLA's float32 power, which is as close on the CPU)."""
    if xp is np:
        return np.power(np.asarray(base, np.float64), np.asarray(exponent, np.float64)).astype(F32)
    return jnp.power(jnp.asarray(base, jnp.float32), jnp.asarray(exponent, jnp.float32))


@functools.lru_cache(maxsize=None)
def _exponents(head_dim: int) -> np.ndarray:
    """transformers' `torch.arange(0, dim, 2, dtype=torch.int64).float() / dim`."""
    return np.arange(0, head_dim, 2, dtype=np.int64).astype(F32) / F32(head_dim)


def _default(theta: float, head_dim: int) -> np.ndarray:
    return np.asarray(F32(1.0) / _pow(F32(theta), _exponents(head_dim), np), F32)


def _llama3(rope: Rope, head_dim: int) -> np.ndarray:
    freq, factor = _default(rope.theta, head_dim), F32(rope.factor)
    old, low, high = (rope.original_max_position_embeddings, rope.low_freq_factor,
                      rope.high_freq_factor)
    low_wavelen, high_wavelen = F32(old / low), F32(old / high)  # torch compares in float32
    wavelen = (F32(2 * math.pi) / freq).astype(F32)
    scaled = np.where(wavelen > low_wavelen, (freq / factor).astype(F32), freq)
    smooth = (((F32(old) / wavelen).astype(F32) - F32(low)).astype(F32) / F32(high - low)).astype(F32)
    smoothed = ((((F32(1) - smooth) * scaled).astype(F32) / factor).astype(F32)
                + (smooth * scaled).astype(F32)).astype(F32)
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(F32)


def _yarn(rope: Rope, head_dim: int) -> np.ndarray:
    dim, base, original = head_dim, rope.theta, rope.original_max_position_embeddings
    pos_freqs = _pow(F32(base), _exponents(dim), np)
    extrapolation = (F32(1) / pos_freqs).astype(F32)
    interpolation = (F32(1) / (F32(rope.factor) * pos_freqs).astype(F32)).astype(F32)

    def correction_dim(rotations: float) -> float:  # float64, as transformers' Python floats
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers: prevent a singular ramp
    ramp = ((np.arange(dim // 2, dtype=F32) - F32(low)).astype(F32) / F32(high - low)).astype(F32)
    extrapolation_factor = (F32(1) - np.clip(ramp, F32(0), F32(1))).astype(F32)
    return np.asarray((interpolation * (F32(1) - extrapolation_factor).astype(F32)).astype(F32)
                      + (extrapolation * extrapolation_factor).astype(F32), F32)


@functools.lru_cache(maxsize=None)
def inv_freq(rope: Rope, head_dim: int) -> np.ndarray:
    """RoPE inverse frequencies [head_dim / 2] float32 (read-only), as transformers computes them;
    for `dynamic`, those of every sequence up to its original length (`dynamic_inv_freq` beyond)."""
    if rope.type in ("default", "dynamic"):
        # dynamic at init: transformers' seq_len = max_position_embeddings, so the base is
        # theta * 1 ** (dim / (dim - 2)), in Python floats
        theta = rope.theta
        if rope.type == "dynamic":
            theta = theta * ((rope.factor * rope.original_max_position_embeddings
                              / rope.original_max_position_embeddings) - (rope.factor - 1)) \
                ** (head_dim / (head_dim - 2))
        freq = _default(theta, head_dim)
    elif rope.type == "linear":
        freq = (_default(rope.theta, head_dim) / F32(rope.factor)).astype(F32)
    elif rope.type == "llama3":
        freq = _llama3(rope, head_dim)
    elif rope.type == "yarn":
        freq = _yarn(rope, head_dim)
    else:
        raise ValueError(f"rope type {rope.type!r} has no frequencies here")
    freq.setflags(write=False)  # shared by every caller of the cache
    return freq


def _mscale(scale: float, mscale: float = 1.0) -> float:
    """transformers' `yarn_get_mscale`."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_scaling(rope: Rope, head_dim: int) -> float:
    """What transformers multiplies cos and sin by: yarn's attention factor, 1.0 for the others."""
    if rope.type != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.mscale and rope.mscale_all_dim:
        return float(_mscale(rope.factor, rope.mscale) / _mscale(rope.factor, rope.mscale_all_dim))
    return _mscale(rope.factor)


def dynamic_inv_freq(rope: Rope, head_dim: int, seq_lens: Any) -> Any:
    """Dynamic NTK inverse frequencies `seq_lens.shape + [head_dim / 2]` float32, each for
    seq_len = max(seq_lens[...], original length), as transformers' `dynamic_rope_update` computes
    them (its seq_len is a tensor there, so the new base is computed in float32). numpy in, numpy
    out; a jax array (traced or not) in, jax out, with no Python branch on its values."""
    xp: Any = np if isinstance(seq_lens, np.ndarray) else jnp
    original, factor = rope.original_max_position_embeddings, rope.factor
    longer = xp.asarray(seq_lens) > original
    s = xp.maximum(xp.asarray(seq_lens), original).astype(F32)
    # factor * seq_len / max_position_embeddings - (factor - 1), each step in float32
    q = ((F32(factor) * s).astype(F32) / F32(original)).astype(F32) - F32(factor - 1)
    # torch raises a float32 tensor to a Python float in float64 and rounds once
    exponent = head_dim / (head_dim - 2)
    if xp is np:
        grown = np.power(q.astype(np.float64), exponent).astype(F32)
    else:
        # no float64 in the graph: q ** hi, then q ** lo = 1 + lo * ln q for the exponent's
        # float32 remainder (the remainder alone moves the power by up to a few ulps). Within
        # one ulp of the host's power, so the frequencies are within a few ulps of transformers'.
        hi = F32(exponent)
        lo = F32(exponent - float(hi))
        grown = jnp.power(q, hi)
        grown = grown + grown * (lo * jnp.log(q))
    base = (F32(rope.theta) * grown).astype(F32)
    freq = (F32(1) / _pow(base[..., None], xp.asarray(_exponents(head_dim)), xp)).astype(F32)
    # at or below the original length transformers keeps the frequencies it started with
    return xp.where(longer[..., None], freq, xp.asarray(inv_freq(rope, head_dim)))


def rope_tables(positions: Any, rope: Rope, head_dim: int, *, seq_lens: Any = None
                ) -> tuple[Any, Any]:
    """cos and sin `[..., 1, head_dim // 2]` float32 for `positions [...]`, times
    `attention_scaling` (as transformers' rotary embedding returns them): numpy in, numpy out
    (on the host); a jax array in (traced or not), jax out (in the graph).

    `seq_lens` (int) is only read for `dynamic` rope, which needs it: each row's seq_len (the
    module docstring says which). Its shape is either positions' minus the last axis, one per
    row of positions (prefill: positions [n, P], seq_lens [n]), or positions' own (decode:
    positions [B], seq_lens [B], seq_len = position + 1 for a sequence decoded one token a step).
    """
    xp: Any = np if isinstance(positions, np.ndarray) and (
        seq_lens is None or isinstance(seq_lens, np.ndarray)) else jnp
    if rope.type == "dynamic":
        if seq_lens is None:
            raise ValueError("rope type 'dynamic' needs each row's seq_len (seq_lens)")
        lens_shape, pos_shape = tuple(np.shape(seq_lens)), tuple(np.shape(positions))
        freq = dynamic_inv_freq(rope, head_dim, seq_lens if xp is np else jnp.asarray(seq_lens))
        if lens_shape == pos_shape[:-1]:
            freq = freq[..., None, :]  # one row of frequencies for the row's positions
        elif lens_shape != pos_shape:
            raise ValueError(f"seq_lens has shape {lens_shape}; positions {pos_shape} need "
                             f"{pos_shape[:-1]} (one per row) or {pos_shape} (one per position)")
    else:
        freq = xp.asarray(inv_freq(rope, head_dim))
    angles = xp.asarray(positions).astype(F32)[..., None] * freq
    cos, sin = xp.cos(angles).astype(F32), xp.sin(angles).astype(F32)
    scale = attention_scaling(rope, head_dim)
    if scale != 1.0:
        cos, sin = (cos * F32(scale)).astype(F32), (sin * F32(scale)).astype(F32)
    return cos[..., None, :], sin[..., None, :]
