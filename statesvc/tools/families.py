"""The example checkpoint of each family as its difference from Llama's (statesvc/tools/example.py
writes them): what its config.json adds, replaces or lacks, what its decoder layers hold, where
its norm weights sit, and its tokenizer (statesvc/tools/tokenizer.py `TOKENIZERS`).

Each config is what transformers 5.25 writes for that family's ``*ForCausalLM`` (checked by
tests/parity/test_example_families.py, which loads each in transformers and in our model),
with options set away from their defaults where the family has them, so the example exercises
them: sliding windows of 8 positions (shorter than the prompts the tests and the demo send),
Qwen2's sliding layers from the middle, Gemma's soft-caps and query scale, Gemma 3's two RoPE
bases with linear scaling on the global one, Granite's four multipliers, Qwen3-MoE's top-k
renormalised. A mixture of experts has `EXPERTS` experts, each token through `EXPERTS_PER_TOK`
(Mixtral's of intermediate_size, Qwen3-MoE's a quarter of it), on every layer.

Adding a family is one `FAMILIES` entry: ``config`` and ``drop`` for config.json, ``layer``
for the tensors of one decoder layer (names under ``model.layers.{i}.``, each with its shape and
how it is drawn: see `INITS`; a MoE family replaces the MLP's entries with its router's and
experts'), ``norm_center``, ``tied`` and ``input_scale``. Pure Python (no numpy): loractl
reads the names.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shared.projections import MODULE_PARENT, MODULES
from statesvc.tools.model_shape import ModelShape
from statesvc.tools.tokenizer import TOKENIZERS, TokenizerSpec

__all__ = ["FAMILIES", "INITS", "Family", "LayerTensors", "family", "llama_layer"]

# name under model.layers.{i} -> (shape as torch saves it, how it is drawn)
LayerTensors = dict[str, tuple[tuple[int, ...], str]]
# How a tensor is drawn (statesvc/tools/example_files.py draws each from its own seeded
# generator):
INITS = {
    "norm": "norm_center + N(0, 0.1)",
    "linear": "N(0, 1/fan_in), fan_in the last axis (torch's [out, in], or [experts, out, in])",
    "bias": "N(0, 0.2)",
    "embed": "N(0, 4/hidden): after the final norm, logits of std about 2; model.embed_tokens "
             "divided by the family's `input_scale` (tied: lm_head with it)",
}
EXPERTS, EXPERTS_PER_TOK = 4, 2  # a mixture of experts' (few and small: a tiny example)
WINDOW = 8  # the sliding window of every family that has one (at most max_position_embeddings)
FULL, SLIDING = "full_attention", "sliding_attention"


def llama_layer(shape: ModelShape) -> LayerTensors:
    """A Llama decoder layer: two norms and the seven projections."""
    h = shape.hidden_size
    out: LayerTensors = {"input_layernorm.weight": ((h,), "norm"),
                         "post_attention_layernorm.weight": ((h,), "norm")}
    for m in MODULES:
        fan_in, fan_out = shape.module_dims(m)
        out[f"{MODULE_PARENT[m]}.{m}.weight"] = ((fan_out, fan_in), "linear")
    return out


def _qkv_bias(shape: ModelShape) -> LayerTensors:
    return {f"self_attn.{m}.bias": ((shape.module_dims(m)[1],), "bias")
            for m in ("q_proj", "k_proj", "v_proj")}


def _qk_norm(shape: ModelShape, *, per_head: bool) -> LayerTensors:
    """q_norm and k_norm: over each head (Qwen3, Gemma 3) or over the whole projection (OLMo 2)."""
    q, k = ((shape.head_dim,) * 2 if per_head else
            (shape.num_attention_heads * shape.head_dim, shape.num_key_value_heads * shape.head_dim))
    return {"self_attn.q_norm.weight": ((q,), "norm"), "self_attn.k_norm.weight": ((k,), "norm")}


def _ffn_norms(shape: ModelShape) -> LayerTensors:
    h = shape.hidden_size
    return {"pre_feedforward_layernorm.weight": ((h,), "norm"),
            "post_feedforward_layernorm.weight": ((h,), "norm")}


def _experts(shape: ModelShape, *, stem: str, names: tuple[str, str, str], size: int) -> LayerTensors:
    """A Llama layer with a sparse MLP under `stem` in place of its MLP: a router (`gate`, drawn
    like a linear) and `EXPERTS` SwiGLU experts of `size`, their gate, up and down projections
    named `names`."""
    h, (gate, up, down) = shape.hidden_size, names
    out = {k: v for k, v in llama_layer(shape).items() if not k.startswith("mlp.")}
    out[f"{stem}.gate.weight"] = ((EXPERTS, h), "linear")
    for e in range(EXPERTS):
        out.update({f"{stem}.experts.{e}.{gate}.weight": ((size, h), "linear"),
                    f"{stem}.experts.{e}.{up}.weight": ((size, h), "linear"),
                    f"{stem}.experts.{e}.{down}.weight": ((h, size), "linear")})
    return out


def _window(shape: ModelShape) -> int:
    return min(WINDOW, shape.max_position_embeddings)


def _alternating(shape: ModelShape) -> list[str]:
    """Local and global layers alternating, local first (Gemma 2's pattern)."""
    return [SLIDING if (i + 1) % 2 else FULL for i in range(shape.num_hidden_layers)]


def _qwen2(shape: ModelShape) -> dict[str, Any]:
    start = shape.num_hidden_layers // 2  # the layers from the middle on slide
    return {"use_sliding_window": True, "sliding_window": _window(shape), "max_window_layers": start,
            "layer_types": [SLIDING if i >= start else FULL for i in range(shape.num_hidden_layers)]}


def _qwen3(shape: ModelShape) -> dict[str, Any]:  # transformers' defaults: no window
    return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": 28,
            "layer_types": [FULL] * shape.num_hidden_layers}


def _gemma(shape: ModelShape) -> dict[str, Any]:
    """What Gemma 2 and 3 share."""
    return {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 2 * shape.head_dim,
            "sliding_window": _window(shape), "layer_types": _alternating(shape)}


def _gemma2(shape: ModelShape) -> dict[str, Any]:
    return {**_gemma(shape), "attn_logit_softcapping": 2.0, "final_logit_softcapping": 1.0,
            "use_bidirectional_attention": None}


def _gemma3(shape: ModelShape) -> dict[str, Any]:
    return {**_gemma(shape), "_sliding_window_pattern": 6, "attn_logit_softcapping": None,
            "final_logit_softcapping": None, "use_bidirectional_attention": False,
            "rope_parameters": {
                FULL: {"factor": 8.0, "rope_theta": 1000000.0, "rope_type": "linear"},
                SLIDING: {"rope_theta": 10000.0, "rope_type": "default"}}}


GRANITE_EMBEDDING_MULTIPLIER = 12.0


def _granite(shape: ModelShape) -> dict[str, Any]:
    return {"embedding_multiplier": GRANITE_EMBEDDING_MULTIPLIER, "attention_multiplier": 1.0 / shape.head_dim,
            "residual_multiplier": 0.22, "logits_scaling": 4.0}


def _moe_size(shape: ModelShape) -> int:
    """Qwen3-MoE's expert size: smaller than the dense MLP's, as the family's are."""
    return max(shape.intermediate_size // 4, 1)


# the routing keys Mixtral and Qwen3-MoE share (transformers 5 writes num_local_experts for both)
_ROUTING: dict[str, Any] = {"num_local_experts": EXPERTS, "num_experts_per_tok": EXPERTS_PER_TOK,
                            "output_router_logits": False, "router_aux_loss_coef": 0.001}


def _mixtral(shape: ModelShape) -> dict[str, Any]:
    return {**_ROUTING, "router_jitter_noise": 0.0, "sliding_window": _window(shape)}


def _qwen3_moe(shape: ModelShape) -> dict[str, Any]:  # Qwen3's attention: no window
    return {**_ROUTING, "moe_intermediate_size": _moe_size(shape), "norm_topk_prob": True,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "use_sliding_window": False,
            "sliding_window": None}


def _none(shape: ModelShape) -> dict[str, Any]:
    return {}


def _one(shape: ModelShape) -> float:
    return 1.0


def _sqrt_hidden(shape: ModelShape) -> float:
    return math.sqrt(shape.hidden_size)


_NOT_LLAMA = ("mlp_bias", "pretraining_tp")  # Llama's keys that most families lack


@dataclass(frozen=True)
class Family:
    """A family's example checkpoint, as its difference from Llama's."""

    model_type: str
    architecture: str  # config.json's "architectures"
    tokenizer: TokenizerSpec  # its special tokens give config.json's bos, eos and pad ids
    config: Callable[[ModelShape], dict[str, Any]] = _none  # keys added or replaced
    drop: tuple[str, ...] = ()  # Llama's keys this family's config.json lacks
    layer: Callable[[ModelShape], LayerTensors] = llama_layer  # one decoder layer's tensors
    norm_center: float = 1.0  # 0.0 where the norm multiplies by (1 + weight): Gemma
    tied: bool = False  # the embeddings are tied whatever the shape says (Gemma's always are)
    # what the model multiplies the embeddings by (Gemma: sqrt(hidden), Granite: its
    # embedding_multiplier); model.embed_tokens is drawn that much smaller, so the residual
    # stream starts at Llama's scale and the blocks (and adapters) move the output: otherwise
    # each token's own embedding outweighs them and a random model repeats its last token
    input_scale: Callable[[ModelShape], float] = _one


FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama", "LlamaForCausalLM", TOKENIZERS["llama"]),
    Family("qwen2", "Qwen2ForCausalLM", TOKENIZERS["qwen2"], _qwen2,
           drop=("attention_bias", *_NOT_LLAMA),
           layer=lambda s: {**llama_layer(s), **_qkv_bias(s)}),
    Family("qwen3", "Qwen3ForCausalLM", TOKENIZERS["qwen3"], _qwen3, drop=_NOT_LLAMA,
           layer=lambda s: {**llama_layer(s), **_qk_norm(s, per_head=True)}),
    Family("mistral", "MistralForCausalLM", TOKENIZERS["mistral"],
           lambda s: {"sliding_window": _window(s)}, drop=("attention_bias", *_NOT_LLAMA)),
    Family("gemma2", "Gemma2ForCausalLM", TOKENIZERS["gemma2"], _gemma2,
           drop=("hidden_act", *_NOT_LLAMA), layer=lambda s: {**llama_layer(s), **_ffn_norms(s)},
           norm_center=0.0, tied=True, input_scale=_sqrt_hidden),
    Family("gemma3_text", "Gemma3ForCausalLM", TOKENIZERS["gemma3"], _gemma3,
           drop=("hidden_act", *_NOT_LLAMA),
           layer=lambda s: {**llama_layer(s), **_ffn_norms(s), **_qk_norm(s, per_head=True)},
           norm_center=0.0, tied=True, input_scale=_sqrt_hidden),
    Family("olmo2", "Olmo2ForCausalLM", TOKENIZERS["olmo2"], drop=_NOT_LLAMA,
           layer=lambda s: {**{k: v for k, v in llama_layer(s).items() if k != "input_layernorm.weight"},
                            "post_feedforward_layernorm.weight": ((s.hidden_size,), "norm"),
                            **_qk_norm(s, per_head=False)}),
    Family("granite", "GraniteForCausalLM", TOKENIZERS["granite"], _granite, drop=("pretraining_tp",),
           input_scale=lambda s: GRANITE_EMBEDDING_MULTIPLIER),
    Family("mixtral", "MixtralForCausalLM", TOKENIZERS["mistral"], _mixtral,
           drop=("attention_bias", *_NOT_LLAMA),
           layer=lambda s: _experts(s, stem="block_sparse_moe", names=("w1", "w3", "w2"),
                                    size=s.intermediate_size)),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", TOKENIZERS["qwen3"], _qwen3_moe, drop=_NOT_LLAMA,
           layer=lambda s: {**_experts(s, stem="mlp", names=("gate_proj", "up_proj", "down_proj"),
                                       size=_moe_size(s)), **_qk_norm(s, per_head=True)}),
)}


def family(name: str) -> Family:
    """The `FAMILIES` entry of `name`; ValueError listing the names when there is none."""
    if name not in FAMILIES:
        raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {name!r}")
    return FAMILIES[name]
