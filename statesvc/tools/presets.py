"""Real geometries for `loractl make-example --preset`: random bfloat16 checkpoints at the shapes
users serve, with rank-16 PEFT adapters on all seven projections (nothing is downloaded).

A preset is the published config.json of a public checkpoint, its sizes and the keys that change
the forward pass (RoPE, norms' eps, tied embeddings, no sliding window), over the family's example
writer (statesvc/tools/example.py): the weights are random, drawn as the small example's are, so
speed, memory and compile time are those of the real model, and its outputs are not. The
tokenizer is the family's example one (trained on the example corpus, far fewer tokens than the
vocab): ids past it decode to nothing, which a random model's output tolerates.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shared.projections import MODULES
from statesvc.tools.adapter_writer import AdapterSpec
from statesvc.tools.model_shape import ModelShape


@dataclass(frozen=True)
class Preset:
    """A public checkpoint's geometry: its family, its sizes and the config.json keys that differ
    from the family's example config (`config`, applied last)."""

    family: str
    shape: ModelShape
    config: dict[str, Any] = field(default_factory=dict, hash=False)
    dtype: str = "bfloat16"

    def adapters(self, count: int, *, rank: int = 16) -> tuple[AdapterSpec, ...]:
        """`count` rank-`rank` adapters (alpha 2 r) on all seven projections, `r16-all-00` ..."""
        return tuple(AdapterSpec(f"r{rank}-all-{i:02d}", r=rank, lora_alpha=2 * rank, target_modules=MODULES)
                     for i in range(count))


PRESETS: dict[str, Preset] = {
    # Qwen/Qwen2.5-0.5B's config.json: 494 M parameters, 0.99 GB in bfloat16
    "qwen2.5-0.5b": Preset("qwen2", ModelShape(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True,
        max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6),
        config={"use_sliding_window": False, "sliding_window": None, "max_window_layers": 21,
                "layer_types": ["full_attention"] * 24}),
    # meta-llama/Llama-3.2-1B's config.json: 1.24 B parameters, 2.47 GB in bfloat16
    "llama-3.2-1b": Preset("llama", ModelShape(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
        max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
}


def preset(name: str) -> Preset:
    """The `PRESETS` entry of `name`; ValueError listing the names when there is none."""
    if name not in PRESETS:
        raise ValueError(f"preset must be one of {', '.join(PRESETS)}, got {name!r}")
    return PRESETS[name]
