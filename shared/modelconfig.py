"""What a replica can serve of a Llama `config.json`: one set of checks for `pool init` and replicas.

`pool init` (shared/fingerprint.py `read_model`) and the replica's model loader
(computed/model/config.py `LlamaConfig.from_hf`) both call `read_architecture`, so a
config that no replica can serve is refused when the pool is configured, with
the text a replica start would print, instead of being recorded in the
immutable genesis event. `check_recordable` bounds what that event records:
the whole config.json travels in `pool.configured`, and a config nested deeper
than the wire decoder's limit would make the log unreadable by every client.

No jax here: statesvc imports this module.
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from shared.canonical import canonical_bytes
from shared.llama import MODULE_PARENT, module_dims

ROPE_TYPES = ("default", "linear", "llama3")
# What `pool.configured` may record of a config.json. Real Llama configs nest 2 levels (a
# rope_scaling or quantization_config object) and take a few KiB; the event carries the config
# about 5 levels deep in an `events` reply, whose decoder refuses nesting deeper than 32.
MAX_MODEL_CONFIG_DEPTH = 8
MAX_MODEL_CONFIG_BYTES = 64 << 10


class ModelConfigError(ValueError):
    """A config.json no replica can serve; the message starts with "config.json: "."""


@dataclass(frozen=True)
class Rope:
    """Rotary embedding parameters (transformers' `rope_parameters`, normalised)."""

    theta: float
    type: str = "default"  # one of ROPE_TYPES
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class Architecture:
    """The Llama architecture a replica builds from config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: Rope
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    max_position_embeddings: int = 2048

    @property
    def module_dims(self) -> dict[str, tuple[int, int]]:
        """Target module -> (in_features, out_features)."""
        return module_dims(hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                           num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                           head_dim=self.head_dim)

    def tensor_shapes(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """Every tensor a replica reads from the checkpoint, with its shape as transformers
        saves it, layer by layer: a generator, since config.json's num_hidden_layers is not
        bounded until the checkpoint is seen to hold that many layers (`check_tensors` stops
        at the first tensor missing; a dict of 2**62 layers' names was an out-of-memory)."""
        h, v = self.hidden_size, self.vocab_size
        yield "model.embed_tokens.weight", (v, h)
        yield "model.norm.weight", (h,)
        if not self.tie_word_embeddings:
            yield "lm_head.weight", (v, h)
        dims = self.module_dims
        for i in range(self.num_layers):
            p = f"model.layers.{i}"
            yield f"{p}.input_layernorm.weight", (h,)
            yield f"{p}.post_attention_layernorm.weight", (h,)
            for m, (n_in, n_out) in dims.items():
                stem = f"{p}.{MODULE_PARENT[m]}.{m}"
                yield f"{stem}.weight", (n_out, n_in)
                if self.attention_bias if MODULE_PARENT[m] == "self_attn" else self.mlp_bias:
                    yield f"{stem}.bias", (n_out,)


def _fail(what: str) -> ModelConfigError:
    return ModelConfigError(f"config.json: {what}")


def _int(cfg: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = cfg.get(key)
    if value is None:  # absent, or null: transformers writes null for "use the default"
        if default is None:
            raise _fail(f"lacks {key!r}")
        value = default
    if type(value) is not int or value < 1:
        raise _fail(f"{key} must be a positive integer, got {value!r}")
    return value


def _float(cfg: Mapping[str, Any], key: str, default: float, *, what: str = "") -> float:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value <= 0:
        raise _fail(f"{what or key} must be a positive number, got {value!r}")
    return float(value)


def read_architecture(cfg: Mapping[str, Any]) -> Architecture:
    """The architecture of a transformers 4.x or 5.x Llama config.json (as a dict); raises
    ModelConfigError saying what no replica can serve."""
    if cfg.get("model_type") != "llama":
        raise _fail(f"model_type must be 'llama', got {cfg.get('model_type')!r}")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise _fail(f"hidden_act {act!r} is not supported (only 'silu')")
    if cfg.get("pretraining_tp", 1) not in (None, 1):
        raise _fail("pretraining_tp other than 1 is not supported")
    hidden = _int(cfg, "hidden_size")
    heads = _int(cfg, "num_attention_heads")
    kv_heads = _int(cfg, "num_key_value_heads", heads)
    head_dim = _int(cfg, "head_dim", hidden // heads)
    max_pos = _int(cfg, "max_position_embeddings", 2048)
    arch = Architecture(
        vocab_size=_int(cfg, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_int(cfg, "intermediate_size"),
        num_layers=_int(cfg, "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_float(cfg, "rms_norm_eps", 1e-6),
        rope=_rope(cfg, max_pos),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        max_position_embeddings=max_pos,
    )
    if heads % kv_heads:
        raise _fail(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    if head_dim % 2:
        raise _fail(f"head_dim {head_dim} must be even for RoPE")
    return arch


def _rope(cfg: Mapping[str, Any], max_pos: int) -> Rope:
    # transformers 5: rope_parameters {rope_type, rope_theta, ...}; 4.x: rope_theta at the top
    # level and rope_scaling {type|rope_type, factor, ...} or null. A file may carry both.
    params, scaling = cfg.get("rope_parameters") or {}, cfg.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise _fail("rope_parameters and rope_scaling must be objects or null")
    if "layer_types" in cfg or any(isinstance(v, dict) for v in params.values()):
        raise _fail("per-layer rope parameters are not supported")
    merged = {**scaling, **params}
    theta = _float({"rope_theta": merged.get("rope_theta", cfg.get("rope_theta", 10000.0))},
                   "rope_theta", 10000.0)
    kind = merged.get("rope_type", merged.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise _fail(f"rope type {kind!r} is not supported ({', '.join(ROPE_TYPES)})")
    if merged.get("partial_rotary_factor", 1.0) != 1.0:
        raise _fail("partial_rotary_factor other than 1 is not supported")
    if kind == "default":
        return Rope(theta=theta)
    if "factor" not in merged:
        raise _fail(f"rope type {kind!r} needs a factor")
    factor = _float(merged, "factor", 1.0, what=f"rope {kind} factor")
    if kind == "linear":
        return Rope(theta=theta, type=kind, factor=factor)
    for key in ("low_freq_factor", "high_freq_factor"):
        if key not in merged:
            raise _fail(f"llama3 rope scaling lacks {key!r}")
    low = _float(merged, "low_freq_factor", 1.0)
    high = _float(merged, "high_freq_factor", 4.0)
    if high <= low:
        raise _fail(f"llama3 rope scaling needs high_freq_factor {high:g} above low_freq_factor {low:g}")
    return Rope(theta=theta, type=kind, factor=factor, low_freq_factor=low, high_freq_factor=high,
                original_max_position_embeddings=_int(merged, "original_max_position_embeddings",
                                                      max_pos))


def check_tensors(arch: Architecture, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Raise ModelConfigError unless the checkpoint (tensor name -> shape) holds every tensor
    `arch` needs, in the shape config.json implies."""
    for name, want in arch.tensor_shapes():
        if name not in shapes:
            raise ModelConfigError(f"the checkpoint has no tensor {name!r}")
        if tuple(shapes[name]) != want:
            raise ModelConfigError(f"{name} has shape {tuple(shapes[name])}, config.json implies {want}")


def check_recordable(cfg: Mapping[str, Any]) -> None:
    """Raise ModelConfigError if `cfg` is too deep or too large for `pool.configured` to record."""
    if _depth(cfg, MAX_MODEL_CONFIG_DEPTH) > MAX_MODEL_CONFIG_DEPTH:
        raise _fail(f"nests deeper than {MAX_MODEL_CONFIG_DEPTH} levels, which the pool's genesis "
                    "event cannot record; remove the nested entries that are not part of the Llama "
                    "architecture")
    size = len(canonical_bytes(cfg))
    if size > MAX_MODEL_CONFIG_BYTES:
        raise _fail(f"takes {size} bytes as recorded, above the {MAX_MODEL_CONFIG_BYTES}-byte limit "
                    "of the pool's genesis event; remove the entries that are not part of the "
                    "Llama architecture")


def _depth(value: Any, limit: int) -> int:
    """How many objects and arrays nest in `value` (a flat object: 1), counted to limit + 1."""
    if isinstance(value, dict):
        children: Any = value.values()
    elif isinstance(value, list):
        children = value
    else:
        return 0
    if limit <= 0:
        return 1
    return 1 + max((_depth(v, limit - 1) for v in children), default=0)
