"""The architecture a checkpoint's config.json describes, and its RoPE frequencies.

The rules (which configs a replica serves, transformers 4.x's and 5.x's forms) live in
shared/modelconfig.py, so that `pool init` and a replica refuse the same configs in the same words.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from shared.modelconfig import Architecture, ModelConfigError, Rope, read_architecture

DTYPES = ("float32", "bfloat16")


class ModelLoadError(ValueError):
    """The checkpoint directory cannot be loaded as a Llama model."""


RopeConfig = Rope  # rotary embedding parameters, normalised (shared/modelconfig.py)


@dataclass(frozen=True)
class LlamaConfig(Architecture):
    """The architecture, read from config.json; hashable (static under jit)."""

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> LlamaConfig:
        """Read a transformers 4.x or 5.x Llama config.json (as a dict), with the checks `pool
        init` makes (shared/modelconfig.py)."""
        try:
            arch = read_architecture(cfg)
        except ModelConfigError as exc:
            raise ModelLoadError(str(exc)) from None
        return cls(**{f.name: getattr(arch, f.name) for f in dataclasses.fields(arch)})


@functools.lru_cache(maxsize=None)
def inv_freq(config: LlamaConfig) -> np.ndarray:
    """RoPE inverse frequencies [head_dim / 2], float32, computed as transformers computes them."""
    rope, dim = config.rope, config.head_dim
    exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    freq = (np.float32(1.0) / np.power(np.float32(rope.theta), exponent)).astype(np.float32)
    if rope.type == "linear":
        freq = (freq / np.float32(rope.factor)).astype(np.float32)
    elif rope.type == "llama3":
        old = rope.original_max_position_embeddings
        low_wavelen = old / rope.low_freq_factor
        high_wavelen = old / rope.high_freq_factor
        wavelen = (np.float32(2 * math.pi) / freq).astype(np.float32)
        scaled = np.where(wavelen > low_wavelen, freq / np.float32(rope.factor), freq).astype(np.float32)
        smooth = ((old / wavelen - rope.low_freq_factor)
                  / (rope.high_freq_factor - rope.low_freq_factor)).astype(np.float32)
        smoothed = ((1 - smooth) * scaled / np.float32(rope.factor) + smooth * scaled).astype(np.float32)
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        freq = np.where(medium, smoothed, scaled).astype(np.float32)
    return np.asarray(freq, np.float32)  # no copy: typed for mypy
