"""Which rotary embeddings a replica serves, read from one layer type's `rope_parameters`.

transformers 5 keeps a model's RoPE in `rope_parameters` (rope_type, rope_theta, factor, ...), or
one such object per layer type; 4.x wrote `rope_scaling` ({type|rope_type, factor, ...}) beside a
top-level `rope_theta`. The caller merges those into one flat mapping per layer type and
`read_rope` normalises it into a `Rope`, refusing what no replica computes the way transformers
does. computed/model/rope.py turns a `Rope` into frequencies and cos/sin tables.

What each type reads, as transformers 5.25 reads it (modeling_rope_utils.py):
- default: rope_theta.
- linear: factor (frequencies divided by it).
- llama3: factor, low_freq_factor, high_freq_factor, original_max_position_embeddings.
- dynamic (NTK): factor; its "original" length is the config's max_position_embeddings, not
  `original_max_position_embeddings` (which transformers ignores for this type).
- yarn: factor (null: max_position_embeddings / original_max_position_embeddings),
  original_max_position_embeddings, beta_fast (32), beta_slow (1), mscale, mscale_all_dim,
  attention_factor, truncate (true).

No jax or numpy here: statesvc imports this module.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn")
DEFAULT_THETA = 10000.0  # transformers' `default_theta`; a family may declare another (Mixtral 1e6)

Fail = Callable[[str], Exception]


@dataclass(frozen=True)
class Rope:
    """Rotary embedding parameters, normalised; hashable (static under jit, a cache key).

    Fields a type does not read keep their defaults, so two configs that compute the same
    frequencies compare equal. `original_max_position_embeddings` is the length the type scales
    from: llama3's and yarn's field, and dynamic's max_position_embeddings.
    """

    theta: float
    type: str = "default"  # one of ROPE_TYPES
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None  # yarn: with mscale_all_dim (both nonzero), sets attention_factor
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # yarn: the cos/sin multiplier; None: from factor
    truncate: bool = True  # yarn: round the correction range out to whole dimensions


def read_rope(params: Mapping[str, Any], *, max_pos: int, head_dim: int, fail: Fail,
              default_theta: float = DEFAULT_THETA) -> Rope:
    """The `Rope` of one layer type's merged rope parameters (`rope_parameters` form; 4.x's `type`
    key is read too); raises `fail(message)` naming the field and the value no replica serves.

    `max_pos` is the config's max_position_embeddings, `default_theta` the family's rope_theta
    when `params` has none. transformers 5.25 reads yarn's `truncate` from the top level of
    `rope_parameters`, so for a config with per-layer-type parameters the caller should drop
    it (transformers truncates there whatever the layer's entry says).
    """
    theta = _positive(params.get("rope_theta", default_theta), "rope_theta", fail)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise fail(f"rope type {kind!r} is not supported ({', '.join(ROPE_TYPES)})")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise fail("partial_rotary_factor other than 1 is not supported")
    if kind == "default":
        return Rope(theta=theta)
    if "factor" not in params:
        raise fail(f"rope type {kind!r} needs a factor")
    if kind == "yarn":
        return _yarn(params, theta, max_pos, fail)
    factor = _positive(params["factor"], f"rope {kind} factor", fail)
    if kind == "linear":
        return Rope(theta=theta, type=kind, factor=factor)
    if kind == "dynamic":
        if head_dim <= 2:  # the NTK base is raised to head_dim / (head_dim - 2)
            raise fail(f"rope type 'dynamic' needs head_dim above 2, got {head_dim}")
        return Rope(theta=theta, type=kind, factor=factor, original_max_position_embeddings=max_pos)
    for key in ("low_freq_factor", "high_freq_factor"):
        if key not in params:
            raise fail(f"llama3 rope scaling lacks {key!r}")
    low = _positive(params["low_freq_factor"], "low_freq_factor", fail)
    high = _positive(params["high_freq_factor"], "high_freq_factor", fail)
    if high <= low:
        raise fail(f"llama3 rope scaling needs high_freq_factor {high:g} above low_freq_factor {low:g}")
    return Rope(theta=theta, type=kind, factor=factor, low_freq_factor=low, high_freq_factor=high,
                original_max_position_embeddings=_original_max(params, max_pos, fail))


def _yarn(params: Mapping[str, Any], theta: float, max_pos: int, fail: Fail) -> Rope:
    original = _original_max(params, max_pos, fail)
    # transformers: a null factor is the ratio of the two lengths (DeepSeek-V3's configs)
    factor = (max_pos / original if params["factor"] is None
              else _positive(params["factor"], "rope yarn factor", fail))
    # transformers reads `params.get(key) or default`: null means the default
    beta_fast = _positive(_or(params.get("beta_fast"), 32.0), "yarn rope beta_fast", fail)
    beta_slow = _positive(_or(params.get("beta_slow"), 1.0), "yarn rope beta_slow", fail)
    if beta_fast < beta_slow:
        raise fail(f"yarn rope needs beta_fast {beta_fast:g} at or above beta_slow {beta_slow:g}")
    attention = params.get("attention_factor")
    truncate = params.get("truncate", True)
    if truncate is not None and not isinstance(truncate, bool):
        raise fail(f"yarn rope truncate must be true or false, got {truncate!r}")
    return Rope(
        theta=theta, type="yarn", factor=factor, original_max_position_embeddings=original,
        beta_fast=beta_fast, beta_slow=beta_slow,
        mscale=_mscale(params, "mscale", fail), mscale_all_dim=_mscale(params, "mscale_all_dim", fail),
        attention_factor=None if attention is None
        else _positive(attention, "yarn rope attention_factor", fail),
        truncate=bool(truncate),  # transformers tests its truthiness: null does not truncate
    )


def _or(value: Any, default: float) -> Any:
    return default if value is None else value


def _number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _positive(value: Any, what: str, fail: Fail) -> float:
    if not _number(value) or value <= 0:
        raise fail(f"{what} must be a positive number, got {value!r}")
    return float(value)


def _mscale(params: Mapping[str, Any], key: str, fail: Fail) -> float | None:
    value = params.get(key)
    if value is None:
        return None
    if not _number(value) or value < 0:
        raise fail(f"yarn rope {key} must be a number at or above 0, got {value!r}")
    return float(value)


def _original_max(params: Mapping[str, Any], max_pos: int, fail: Fail) -> int:
    value = params.get("original_max_position_embeddings")
    if value is None:  # transformers' standardisation fills in max_position_embeddings
        return max_pos
    if type(value) is not int or value < 1:
        raise fail(f"original_max_position_embeddings must be a positive integer, got {value!r}")
    return value
