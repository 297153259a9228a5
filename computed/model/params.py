"""The model's parameters: a pytree of weights, with the architecture and the backend as static metadata.

Projection weights and the lm_head are `[in, out]` (HF stores `[out, in]`) for XLA's dot, or
packed into column panels for the native dense kernel (`PackedWeight`, as the backend's
`panel` asks; computed/model/loader.py `with_layout`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from computed.model.config import LlamaConfig

if TYPE_CHECKING:  # the backend package imports this module
    from computed.backend.base import Backend


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PackedWeight:
    """W [in, out] packed for the dense kernel: `panels [ceil(out / panel), in, panel]` float32.

    Each panel is `panel` consecutive output columns whose `in` rows lie one after another, the
    last panel zero-padded: the dense kernel (computed/backend/kernels/dense.cc) streams that layout
    exactly once per product, which is what a decode step wants (few rows, weights too large for
    the cache); XLA's dot packs W into blocks on every call instead."""

    panels: jax.Array
    out: int = field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int]:
        """W's logical shape [in, out]."""
        return int(self.panels.shape[1]), self.out


def pack(w: np.ndarray | jax.Array, panel: int) -> PackedWeight:
    """W [in, out] float32 -> its panels (host work, once per weight)."""
    w = np.asarray(w, np.float32)
    n_in, out = w.shape
    count = -(-out // panel)
    padded = np.zeros((n_in, count * panel), np.float32)
    padded[:, :out] = w
    return PackedWeight(jnp.asarray(np.ascontiguousarray(padded.reshape(n_in, count, panel).transpose(1, 0, 2))),
                        out)


def unpack(w: PackedWeight) -> jax.Array:
    """The panels back to W [in, out]."""
    panels = np.asarray(w.panels)
    n_in = panels.shape[1]
    return jnp.asarray(np.ascontiguousarray(panels.transpose(1, 0, 2).reshape(n_in, -1)[:, :w.out]))


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LayerParams:
    """One decoder layer. Projection weights are stored [in, out], or packed (PackedWeight)."""

    input_norm: jax.Array           # [hidden]
    post_attention_norm: jax.Array  # [hidden]
    weights: dict[str, jax.Array | PackedWeight]  # module -> [in, out]
    biases: dict[str, jax.Array]    # module -> [out]; empty without attention/mlp bias


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["embed", "layers", "norm", "lm_head"], meta_fields=["config", "backend"])
@dataclass(frozen=True)
class LlamaParams:
    config: LlamaConfig
    backend: Backend                # what computes the forward pass, chosen once at load
    embed: jax.Array | None         # [vocab, hidden]; None when tied and packed (lm_head holds it)
    layers: tuple[LayerParams, ...]
    norm: jax.Array                 # [hidden]
    # [hidden, vocab] (as the projections); None when tied to embed, unless packed: a tied model's
    # packed lm_head is the embedding's only copy, and lookups read its columns (llama.py `_embed`)
    lm_head: jax.Array | PackedWeight | None

    @property
    def dtype(self) -> jnp.dtype:
        if self.embed is None:
            assert isinstance(self.lm_head, PackedWeight)
            return self.lm_head.panels.dtype
        return self.embed.dtype
