"""What a replica can serve of a family's `config.json`: one set of checks for `pool init` and replicas.

`pool init` (shared/fingerprint.py `read_model`) and the replica's model loader
(computed/model/config.py `DecoderConfig.from_hf`) both call `read_architecture`, so a
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
from shared.projections import ATTN_MODULES, MLP_MODULES, MODULE_PARENT, module_dims
from shared.rope import ROPE_TYPES, Rope, read_rope

__all__ = ["ROPE_TYPES", "Rope"]

# What `pool.configured` may record of a config.json. Real configs nest 2 levels (a
# rope_scaling or quantization_config object) and take a few KiB; the event carries the config
# about 5 levels deep in an `events` reply, whose decoder refuses nesting deeper than 32.
MAX_MODEL_CONFIG_DEPTH = 8
MAX_MODEL_CONFIG_BYTES = 64 << 10


class ModelConfigError(ValueError):
    """A config.json no replica can serve; the message starts with "config.json: "."""


FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "olmo2", "granite",
            "mixtral", "qwen3_moe")
MOE_FAMILIES = ("mixtral", "qwen3_moe")
FULL, SLIDING = "full_attention", "sliding_attention"
# transformers' activation names a family's MLP may use, and what we compute for each
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


@dataclass(frozen=True)
class Architecture:
    """The decoder a replica builds from config.json: Llama's fields, then what a family changes
    (each default is Llama's, so a family is its difference from Llama; docs/adapters.md lists
    the families and the options of each)."""

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
    attention_bias: bool = False  # q, k, v and o
    mlp_bias: bool = False
    max_position_embeddings: int = 2048
    model_type: str = "llama"
    qkv_bias: bool = False  # q, k and v only (Qwen2)
    # "llama": weight * x.astype(dtype); "gemma": (x * (1 + weight)) in float32, then cast;
    # "olmo": (weight * x) in float32, then cast
    norm: str = "llama"
    # "pre": norm -> block -> add (Llama); "sandwich": also a norm after each block (Gemma 2/3);
    # "post": only the norm after each block (OLMo 2)
    layout: str = "pre"
    qk_norm: str = ""  # "" | "head": q and k normed per head (Qwen3, Gemma 3) | "full": over the projection (OLMo 2)
    act: str = "silu"  # the MLP's activation: "silu" | "gelu_tanh"
    embed_multiplier: float = 1.0
    embed_multiplier_in_dtype: bool = False  # Gemma rounds sqrt(hidden) to the model dtype first
    query_scale: float | None = None  # the score scale; None: head_dim ** -0.5
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    sliding_window: int = 0
    layer_types: tuple[str, ...] = ()  # per layer FULL or SLIDING; () is all FULL
    local_rope: Rope | None = None  # the sliding layers' RoPE where it differs (Gemma 3)
    # mixture of experts (Mixtral, Qwen3-MoE): a sparse layer's MLP is `num_experts` SwiGLU
    # experts of `expert_size`, each token through the `experts_per_tok` its router ranks first
    num_experts: int = 0  # 0: every MLP is dense
    experts_per_tok: int = 0
    expert_size: int = 0
    norm_topk: bool = True  # the top-k routing weights renormalised to sum to 1
    route_in_dtype: bool = False  # the routing weights rounded to the model dtype (Qwen3-MoE)
    dense_layers: tuple[int, ...] = ()  # a MoE model's layers with a dense MLP (Qwen3-MoE's mlp_only_layers)

    @property
    def module_dims(self) -> dict[str, tuple[int, int]]:
        """LoRA target module -> (in_features, out_features): the seven projections, or a MoE
        model's attention projections (LoRA on experts is refused: docs/adapters.md)."""
        dims = self.projection_dims
        return {m: dims[m] for m in ATTN_MODULES} if self.num_experts else dims

    @property
    def projection_dims(self) -> dict[str, tuple[int, int]]:
        """Every dense projection of a layer -> (in_features, out_features), LoRA target or not."""
        return module_dims(hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                           num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                           head_dim=self.head_dim)

    def sparse(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_layers

    def moe_names(self, layer: int) -> tuple[str, tuple[tuple[str, str, str], ...]]:
        """A sparse layer's tensors as transformers saves them: the router's weight, and each
        expert's (gate, up, down) weights."""
        p = f"model.layers.{layer}"
        stem, (gate, up, down) = ((f"{p}.block_sparse_moe", ("w1", "w3", "w2")) if self.model_type == "mixtral"
                                  else (f"{p}.mlp", ("gate_proj", "up_proj", "down_proj")))
        return f"{stem}.gate.weight", tuple(
            (f"{stem}.experts.{e}.{gate}.weight", f"{stem}.experts.{e}.{up}.weight", f"{stem}.experts.{e}.{down}.weight")
            for e in range(self.num_experts))

    @property
    def bias_modules(self) -> tuple[str, ...]:
        """The projections that carry a bias."""
        attn = ATTN_MODULES if self.attention_bias else ("q_proj", "k_proj", "v_proj") if self.qkv_bias else ()
        return attn + (MLP_MODULES if self.mlp_bias else ())

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window (0: it attends to every earlier position)."""
        return self.sliding_window if self.layer_types and self.layer_types[layer] == SLIDING else 0

    def rope_index(self, layer: int) -> int:
        """Which of `ropes` layer `layer` uses."""
        return 1 if self.local_rope is not None and self.window(layer) else 0

    @property
    def ropes(self) -> tuple[Rope, ...]:
        """The distinct RoPEs of the layers: the global one, then the sliding layers' if it differs."""
        return (self.rope,) if self.local_rope is None else (self.rope, self.local_rope)

    def layer_norms(self) -> tuple[str, ...]:
        """The norms of a decoder layer, by their name in the checkpoint (under the layer, or
        under its self_attn for q_norm and k_norm)."""
        names = {"pre": ("input_layernorm", "post_attention_layernorm"),
                 "sandwich": ("input_layernorm", "post_attention_layernorm",
                              "pre_feedforward_layernorm", "post_feedforward_layernorm"),
                 "post": ("post_attention_layernorm", "post_feedforward_layernorm")}[self.layout]
        return names + (("q_norm", "k_norm") if self.qk_norm else ())

    def norm_dims(self, name: str) -> int:
        if name in ("q_norm", "k_norm"):
            if self.qk_norm == "head":
                return self.head_dim
            return (self.num_heads if name == "q_norm" else self.num_kv_heads) * self.head_dim
        return self.hidden_size

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
        dims, biased = self.projection_dims, self.bias_modules
        for i in range(self.num_layers):
            p = f"model.layers.{i}"
            for name in self.layer_norms():
                parent = f"{p}.self_attn" if name in ("q_norm", "k_norm") else p
                yield f"{parent}.{name}.weight", (self.norm_dims(name),)
            if self.sparse(i):
                router, experts = self.moe_names(i)
                yield router, (self.num_experts, h)
                for gate, up, down in experts:
                    yield gate, (self.expert_size, h)
                    yield up, (self.expert_size, h)
                    yield down, (h, self.expert_size)
            for m, (n_in, n_out) in dims.items():
                if self.sparse(i) and m in MLP_MODULES:
                    continue
                stem = f"{p}.{MODULE_PARENT[m]}.{m}"
                yield f"{stem}.weight", (n_out, n_in)
                if m in biased:
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


def _optional_positive(cfg: Mapping[str, Any], key: str) -> float:
    """A positive number, or 0.0 for absent or null (an option that is off)."""
    if cfg.get(key) is None:
        return 0.0
    return _float(cfg, key, 1.0)


def read_architecture(cfg: Mapping[str, Any]) -> Architecture:
    """The architecture of a transformers 4.x or 5.x config.json (as a dict) of one of
    FAMILIES; raises ModelConfigError naming the field and the value no replica can serve."""
    family = cfg.get("model_type")
    if family not in FAMILIES:
        raise _fail(f"model_type must be one of {', '.join(FAMILIES)}, got {family!r}")
    gemma = family in ("gemma2", "gemma3_text")
    act_key = "hidden_activation" if gemma and cfg.get("hidden_activation") is not None else "hidden_act"
    act = cfg.get(act_key, "gelu_pytorch_tanh" if gemma else "silu")
    allowed = "gelu_pytorch_tanh" if gemma else "silu"
    if act != allowed:
        raise _fail(f"{act_key} {act!r} is not supported for {family} (only {allowed!r})")
    if cfg.get("pretraining_tp", 1) not in (None, 1):
        raise _fail("pretraining_tp other than 1 is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise _fail("use_bidirectional_attention is not supported (a causal decoder only)")
    hidden = _int(cfg, "hidden_size")
    heads = _int(cfg, "num_attention_heads")
    kv_heads = _int(cfg, "num_key_value_heads", heads)
    head_dim = _int(cfg, "head_dim", hidden // heads)
    layers = _int(cfg, "num_hidden_layers")
    max_pos = _int(cfg, "max_position_embeddings", 2048)
    if heads % kv_heads:
        raise _fail(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    if head_dim % 2:
        raise _fail(f"head_dim {head_dim} must be even for RoPE")
    rope, local_rope = _ropes(cfg, family, max_pos, head_dim)
    window, layer_types = _windows(cfg, family, layers, max_pos)
    options: dict[str, Any] = {}
    if family == "qwen2":
        options.update(qkv_bias=True)
    if family in ("qwen3", "gemma3_text"):
        options.update(qk_norm="head")
    if gemma:
        options.update(norm="gemma", layout="sandwich", act="gelu_tanh", embed_multiplier=math.sqrt(hidden),
                       embed_multiplier_in_dtype=True,
                       query_scale=_float(cfg, "query_pre_attn_scalar", 256.0) ** -0.5,
                       attn_softcap=_optional_positive(cfg, "attn_logit_softcapping"),
                       final_softcap=_optional_positive(cfg, "final_logit_softcapping"))
    if family == "olmo2":
        options.update(norm="olmo", layout="post", qk_norm="full")
    if family in MOE_FAMILIES:
        options.update(_experts(cfg, family, layers))
    if family == "qwen3_moe":
        options.update(qk_norm="head")
    if family == "granite":
        options.update(embed_multiplier=_float(cfg, "embedding_multiplier", 1.0),
                       query_scale=_float(cfg, "attention_multiplier", 1.0),
                       residual_multiplier=_float(cfg, "residual_multiplier", 1.0),
                       logits_scaling=_float(cfg, "logits_scaling", 1.0))
    return Architecture(
        vocab_size=_int(cfg, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_int(cfg, "intermediate_size"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_float(cfg, "rms_norm_eps", 1e-6),
        rope=rope,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
        attention_bias=family not in ("qwen2", "mistral", "mixtral") and bool(cfg.get("attention_bias", False)),
        mlp_bias=family in ("llama", "granite") and bool(cfg.get("mlp_bias", False)),
        max_position_embeddings=max_pos,
        model_type=family,
        sliding_window=window,
        layer_types=layer_types,
        local_rope=local_rope,
        **options,
    )


def _experts(cfg: Mapping[str, Any], family: str, layers: int) -> dict[str, Any]:
    """A MoE family's expert options as transformers 5 reads them (Mixtral: every layer sparse,
    top-k always renormalised; Qwen3-MoE: `norm_topk_prob`, dense layers from `mlp_only_layers`
    and `decoder_sparse_step`), checked against each other."""
    # transformers 5 saves num_local_experts for both; Qwen3-MoE's own name is num_experts
    key = "num_local_experts" if cfg.get("num_local_experts") is not None or family == "mixtral" else "num_experts"
    experts = _int(cfg, key, 8 if family == "mixtral" else 128)
    top_k = _int(cfg, "num_experts_per_tok", 2 if family == "mixtral" else 8)
    if top_k > experts:
        raise _fail(f"num_experts_per_tok {top_k} is larger than {key} {experts}: a token cannot "
                    "be routed to more experts than there are")
    if family == "mixtral":
        return dict(num_experts=experts, experts_per_tok=top_k, expert_size=_int(cfg, "intermediate_size"))
    norm_topk = cfg.get("norm_topk_prob", False)
    if not isinstance(norm_topk, bool):
        raise _fail(f"norm_topk_prob must be true or false, got {norm_topk!r}")
    step = _int(cfg, "decoder_sparse_step", 1)
    only = cfg.get("mlp_only_layers") or []
    if not isinstance(only, list) or any(type(i) is not int or not 0 <= i < layers for i in only):
        raise _fail(f"mlp_only_layers must be a list of layer indices below num_hidden_layers {layers}, "
                    f"got {only!r}")
    dense = tuple(i for i in range(layers) if i in only or (i + 1) % step)
    return dict(num_experts=experts, experts_per_tok=top_k, expert_size=_int(cfg, "moe_intermediate_size"),
                norm_topk=norm_topk, route_in_dtype=True, dense_layers=dense)


def _windows(cfg: Mapping[str, Any], family: str, layers: int, max_pos: int) -> tuple[int, tuple[str, ...]]:
    """(the sliding window, each layer's attention type) as transformers 5 derives them, checked
    against each other and against max_position_embeddings."""
    window = cfg.get("sliding_window")
    if family in ("qwen2", "qwen3", "qwen3_moe") and not cfg.get("use_sliding_window", False):
        window = None  # transformers drops the window when use_sliding_window is off
    if family in ("llama", "olmo2", "granite"):
        if window is not None or cfg.get("layer_types") is not None and any(
                t != FULL for t in cfg.get("layer_types") or ()):
            raise _fail(f"sliding_window is not part of {family}: remove sliding_window and layer_types")
        return 0, ()
    if window is None:
        return 0, ()
    if type(window) is not int or window < 1:
        raise _fail(f"sliding_window must be a positive integer or null, got {window!r}")
    if window > max_pos:
        raise _fail(f"sliding_window {window} is larger than max_position_embeddings {max_pos}: "
                    "a window cannot reach past the positions the model has")
    if family in ("mistral", "mixtral", "qwen3_moe"):  # every layer slides (layer_types ignored)
        return window, (SLIDING,) * layers
    types = cfg.get("layer_types")
    if types is None:
        if family == "gemma2":
            types = [SLIDING if (i + 1) % 2 else FULL for i in range(layers)]
        elif family == "gemma3_text":
            pattern = cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6))
            if type(pattern) is not int or pattern < 1:
                raise _fail(f"sliding_window_pattern must be a positive integer, got {pattern!r}")
            types = [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
        else:  # qwen2, qwen3
            start = cfg.get("max_window_layers", 28)
            if type(start) is not int or start < 0:
                raise _fail(f"max_window_layers must be a non-negative integer, got {start!r}")
            types = [SLIDING if i >= start else FULL for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers:
        n = len(types) if isinstance(types, list) else types
        raise _fail(f"layer_types has {n!r} entries; num_hidden_layers is {layers}: give one per layer")
    for i, t in enumerate(types):
        if t not in (FULL, SLIDING):
            raise _fail(f"layer_types[{i}] must be {FULL!r} or {SLIDING!r}, got {t!r}")
    return window, tuple(types)


def _ropes(cfg: Mapping[str, Any], family: str, max_pos: int, head_dim: int) -> tuple[Rope, Rope | None]:
    """(the global RoPE, the sliding layers' where it differs). transformers 5: rope_parameters
    {rope_type, rope_theta, ...}, or one such object per layer type (Gemma 3); 4.x: rope_theta
    at the top level and rope_scaling {type|rope_type, factor, ...} or null, and Gemma 3's
    rope_local_base_freq. A file may carry both forms."""
    params, scaling = cfg.get("rope_parameters") or {}, cfg.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise _fail("rope_parameters and rope_scaling must be objects or null")
    per_type = any(isinstance(v, dict) for v in params.values())
    if per_type and family != "gemma3_text":
        raise _fail(f"per-layer rope parameters are not part of {family}")
    top = {"rope_theta": cfg["rope_theta"]} if cfg.get("rope_theta") is not None else {}
    if family != "gemma3_text":
        return read_rope({**top, **scaling, **params}, max_pos=max_pos, head_dim=head_dim, fail=_fail), None
    if per_type:
        for key in params:
            if key not in (FULL, SLIDING):
                raise _fail(f"rope_parameters has {key!r}; Gemma 3's are {FULL!r} and {SLIDING!r}")
        full, local = dict(params.get(FULL) or {}), dict(params.get(SLIDING) or {})
    else:
        full = {**top, **scaling, **params}
        local = {"rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
    full.pop("truncate", None), local.pop("truncate", None)  # transformers always truncates here
    full.setdefault("rope_theta", 1000000.0)
    local.setdefault("rope_theta", 10000.0)
    rope = read_rope(full, max_pos=max_pos, head_dim=head_dim, fail=_fail)
    local_rope = read_rope(local, max_pos=max_pos, head_dim=head_dim, fail=_fail)
    return rope, None if local_rope == rope else local_rope


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
                    "event cannot record; remove the nested entries that are not part of the "
                    "family's architecture")
    size = len(canonical_bytes(cfg))
    if size > MAX_MODEL_CONFIG_BYTES:
        raise _fail(f"takes {size} bytes as recorded, above the {MAX_MODEL_CONFIG_BYTES}-byte limit "
                    "of the pool's genesis event; remove the entries that are not part of the "
                    "family's architecture")


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
