"""A checkpoint's sizes (`ModelShape`): what the example's model (statesvc/tools/example.py), its
adapters (adapter_writer.py), each family's tensors (families.py) and the presets (presets.py) are
written over. A room of its own, below all four, so none of them imports another for it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shared.projections import MODULES, module_dims

__all__ = ["ModelShape"]


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a checkpoint (the fields DecoderConfig takes; a family's own options come
    from its `FAMILIES` entry, which may also tie the embeddings: Gemma's always are)."""

    vocab_size: int = 512  # 3 special tokens, 256 bytes and the example tokenizer's merges
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2  # grouped-query attention
    head_dim: int = 16
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 256
    rope_theta: float = 10000.0
    # e.g. {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
    #       "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    rms_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even for rotary embeddings")
        if self.rope_scaling is not None and "rope_type" not in self.rope_scaling:
            raise ValueError("rope_scaling must name its rope_type")

    def module_dims(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of a projection."""
        dims = module_dims(hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                           num_heads=self.num_attention_heads,
                           num_kv_heads=self.num_key_value_heads, head_dim=self.head_dim)
        if module not in dims:
            raise ValueError(f"unknown module {module!r}; expected one of {MODULES}")
        return dims[module]
