"""The model's parameters: a pytree of weights, with the architecture and the backend as static metadata.

Projection weights and the lm_head are `[in, out]` (HF stores `[out, in]`) for XLA's dot, or
packed into column panels for the native dense kernel (`PackedWeight`, computed/model/packed.py,
as the backend's `panel` asks; computed/model/loader.py `with_layout`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from computed.model.config import DecoderConfig
from computed.model.packed import PackedWeight

if TYPE_CHECKING:  # computed/backend/__init__.py imports this module (tp.py, through model/sharding.py)
    from computed.backend.base import Backend


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Experts:
    """A sparse layer's mixture of experts (computed/model/moe.py), in the model dtype, for XLA's
    dot: each expert's weights an array of its own (up to moe.SPLIT_MAX experts), else stacked."""

    router: jax.Array   # [hidden, experts]
    # [experts, hidden, 2 * expert_size], or one [hidden, 2 * expert_size] per expert: each
    # expert's gate, then its up
    gate_up: jax.Array | tuple[jax.Array, ...]
    down: jax.Array | tuple[jax.Array, ...]  # [experts, expert_size, hidden], or one [expert_size, hidden] each


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LayerParams:
    """One decoder layer. Projection weights are stored [in, out], or packed (PackedWeight)."""

    # the layer's norms by their checkpoint name (input_layernorm, post_attention_layernorm, and
    # the family's: pre_/post_feedforward_layernorm, q_norm, k_norm; DecoderConfig.layer_norms)
    norms: dict[str, jax.Array]
    weights: dict[str, jax.Array | PackedWeight]  # module -> [in, out]
    biases: dict[str, jax.Array]    # module -> [out]; empty without attention/mlp bias
    experts: Experts | None = None  # a sparse layer's MLP (then `weights` has no MLP projections)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["embed", "layers", "norm", "lm_head"], meta_fields=["config", "backend"])
@dataclass(frozen=True)
class DecoderParams:
    config: DecoderConfig
    backend: Backend                # what computes the forward pass, chosen once at load
    embed: jax.Array | None         # [vocab, hidden]; None when tied and packed (lm_head holds it)
    layers: tuple[LayerParams, ...]
    norm: jax.Array                 # [hidden]
    # [hidden, vocab] (as the projections); None when tied to embed, unless packed: a tied model's
    # packed lm_head is the embedding's only copy, and lookups read its columns (decoder.py `_embed`)
    lm_head: jax.Array | PackedWeight | None

    @property
    def dtype(self) -> jnp.dtype:
        if self.embed is None:
            assert isinstance(self.lm_head, PackedWeight)
            return self.lm_head.dtype
        return self.embed.dtype
