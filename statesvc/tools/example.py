"""A tiny random checkpoint of any served family and PEFT LoRA adapters, written as HF writes them.

Only numpy, json and ``safetensors.numpy`` are used (no torch, jax or
transformers), so the state service can build example assets by itself.
The layouts mirror what transformers 5.24 (``save_pretrained``) and PEFT 0.21
(``LoraConfig.save_pretrained``) write; the checkpoint config also carries the
transformers 4.x keys (``torch_dtype``, ``rope_theta``, ``rope_scaling``) unless
asked otherwise, and both major versions load it.

This module writes the checkpoint and puts the example together (`make_example`); the
adapters are written by statesvc/tools/adapter_writer.py, both over the sizes of
statesvc/tools/model_shape.py (`ModelShape`), and every file by
statesvc/tools/example_files.py (seeded draws, safetensors, JSON). Their names are importable
from here too.

A family other than Llama is its entry in `FAMILIES`: what its config.json adds, replaces or
lacks against Llama's, what its decoder layers hold against Llama's, where its norm weights
sit, and its tokenizer (statesvc/tools/tokenizer.py `TOKENIZERS`). Those configs are written as
transformers 5 writes them (``config_style="v5"``; only Llama also carries the 4.x keys).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from statesvc.tools.adapter_writer import (EXAMPLE_ADAPTERS, MOE_EXAMPLE_ADAPTERS, AdapterSpec,
                                           adapter_config, adapter_tensor_names,
                                           example_adapters, lora_targets, write_adapter)
from statesvc.tools.example_files import (DTYPES, encode_safetensors, normal, save_tensors,
                                          write_json, write_safetensors)
from statesvc.tools.families import FAMILIES, INITS, Family
from statesvc.tools.families import family as _family
from statesvc.tools.model_shape import ModelShape
from statesvc.tools.tokenizer import write_tokenizer

__all__ = [
    "EXAMPLE_ADAPTERS",
    "EXAMPLE_BASE_MODEL_NAME",
    "FAMILIES",
    "MOE_EXAMPLE_ADAPTERS",
    "AdapterSpec",
    "ExampleAssets",
    "Family",
    "ModelShape",
    "adapter_config",
    "adapter_tensor_names",
    "example_adapters",
    "lora_targets",
    "make_example",
    "model_config",
    "model_tensor_names",
    "write_adapter",
    "write_model",
    "encode_safetensors",
    "generation_config",
    "shaped",
    "write_safetensors",
]

ConfigStyle = Literal["both", "v5", "v4"]

# The versions whose on-disk layouts are mirrored here (PEFT's: adapter_writer.PEFT_VERSION).
TRANSFORMERS_VERSION = "5.24.0"
TRANSFORMERS_V4_VERSION = "4.46.3"
EXAMPLE_BASE_MODEL_NAME = "loraplane/tiny-random-llama"


@dataclass(frozen=True)
class ExampleAssets:
    """Where make_example put things."""

    root: Path
    model_dir: Path
    adapter_dirs: dict[str, Path]
    shape: ModelShape  # as written (`shaped`: a Gemma example's embeddings are tied)
    adapters: tuple[AdapterSpec, ...]
    family: str = "llama"


# --------------------------------------------------------------------------- model

def shaped(shape: ModelShape, family: str = "llama") -> ModelShape:
    """`shape` as the family writes it (Gemma's embeddings are always tied)."""
    if _family(family).tied and not shape.tie_word_embeddings:
        return replace(shape, tie_word_embeddings=True)
    return shape


def _tensor_specs(shape: ModelShape, family: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor of the checkpoint: name -> (shape, how it is drawn: families.INITS)."""
    fam, shape = _family(family), shaped(shape, family)
    h, v = shape.hidden_size, shape.vocab_size
    specs = {"model.embed_tokens.weight": ((v, h), "embed"), "model.norm.weight": ((h,), "norm")}
    if not shape.tie_word_embeddings:
        specs["lm_head.weight"] = ((v, h), "embed")
    layer = fam.layer(shape)
    for i in range(shape.num_hidden_layers):
        specs.update({f"model.layers.{i}.{name}": spec for name, spec in layer.items()})
    return specs


def model_tensor_names(shape: ModelShape, family: str = "llama") -> list[str]:
    """The tensor names of a checkpoint of this shape and family, sorted."""
    return sorted(_tensor_specs(shape, family))


def _model_tensors(shape: ModelShape, seed: int, family: str = "llama") -> dict[str, npt.NDArray[np.float32]]:
    specs, center = _tensor_specs(shape, family), np.float32(_family(family).norm_center)
    # Embedding rows of std 2/sqrt(h): after the final RMSNorm the hidden state has
    # unit RMS, so logits come out with std around 2 (tied or not).
    emb_std = 2.0 / math.sqrt(shape.hidden_size)
    out: dict[str, npt.NDArray[np.float32]] = {}
    for name in sorted(specs):
        dims, init = specs[name]
        key = (name,)
        if init == "norm":
            norm = normal(seed, key, dims, 0.1)
            norm += center
            out[name] = norm
        elif init == "embed":
            scale = _family(family).input_scale(shape) if name == "model.embed_tokens.weight" else 1.0
            out[name] = normal(seed, key, dims, emb_std / scale)
        elif init == "linear":
            # torch Linear layout [out, in]; std 1/sqrt(fan_in) keeps activations O(1).
            out[name] = normal(seed, key, dims, 1.0 / math.sqrt(dims[-1]))
        elif init == "bias":
            out[name] = normal(seed, key, dims, 0.2)
        else:
            raise ValueError(f"{name}: unknown init {init!r}; expected one of {', '.join(INITS)}")
    return out


def model_config(shape: ModelShape, *, dtype: str = "float32", style: ConfigStyle | None = None,
                 family: str = "llama", overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config.json transformers writes for the family's ``*ForCausalLM`` of this shape.

    ``style``: "v5" is what transformers 5 writes (``dtype``, ``rope_parameters``),
    "v4" what 4.x writes (``torch_dtype``, ``rope_theta``, ``rope_scaling``),
    "both" carries both sets of keys (Llama's default; each version reads it). Families
    other than Llama are written as transformers 5 writes them ("v5", their default).
    `overrides` replace keys last (a real checkpoint's, statesvc/tools/presets.py).
    """
    fam = _family(family)
    if style is None:
        style = "both" if family == "llama" else "v5"
    if style not in ("v4", "v5", "both"):
        raise ValueError(f"style must be v4, v5 or both, got {style!r}")
    if family != "llama" and style != "v5":
        raise ValueError(f"{family} is written as transformers 5 writes it: style must be v5, "
                         f"got {style!r}")
    shape = shaped(shape, family)
    tok = fam.tokenizer
    cfg: dict[str, Any] = {
        "architectures": [fam.architecture],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": tok.token_id("bos_token"),
        "eos_token_id": tok.token_id("eos_token"),
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "hidden_size": shape.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": shape.intermediate_size,
        "max_position_embeddings": shape.max_position_embeddings,
        "mlp_bias": False,
        "model_type": fam.model_type,
        "num_attention_heads": shape.num_attention_heads,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_key_value_heads": shape.num_key_value_heads,
        "pretraining_tp": 1,
        "rms_norm_eps": shape.rms_norm_eps,
        "tie_word_embeddings": shape.tie_word_embeddings,
        "use_cache": True,
        "vocab_size": shape.vocab_size,
    }
    if style in ("v5", "both"):
        rope: dict[str, Any] = {"rope_type": "default"}
        if shape.rope_scaling is not None:
            rope = {k: v for k, v in shape.rope_scaling.items() if k != "type"}
        rope["rope_theta"] = shape.rope_theta
        cfg.update(dtype=dtype, pad_token_id=tok.token_id("pad_token"), rope_parameters=rope,
                   transformers_version=TRANSFORMERS_VERSION)
    if style in ("v4", "both"):
        scaling = None if shape.rope_scaling is None else dict(shape.rope_scaling)
        cfg.update(torch_dtype=dtype, rope_theta=shape.rope_theta, rope_scaling=scaling)
        if style == "v4":
            cfg["transformers_version"] = TRANSFORMERS_V4_VERSION
    for key in fam.drop:
        del cfg[key]
    cfg.update(fam.config(shape))
    cfg.update(overrides or {})
    return cfg


def generation_config(cfg: dict[str, Any], *, family: str = "llama") -> dict[str, Any]:
    """The generation_config.json transformers derives from a model's config.json; for a family
    whose checkpoints end an answer on more tokens than eos (Gemma's <end_of_turn>, Qwen's
    <|endoftext|>), what ``GenerationConfig(bos_token_id=, eos_token_id=[eos, ...],
    pad_token_id=).save_pretrained`` writes instead, as those checkpoints' files are."""
    ids = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg.get(k) is not None}
    eos = _family(family).tokenizer.eos_ids
    if len(eos) > 1:
        return {**ids, "eos_token_id": eos, "transformers_version": cfg["transformers_version"]}
    return {"_from_model_config": True, **ids, "output_attentions": False,
            "output_hidden_states": False, "transformers_version": cfg["transformers_version"],
            "use_cache": True}


def write_model(dir: Path, shape: ModelShape = ModelShape(), *, seed: int = 0,
                dtype: str = "float32", config_style: ConfigStyle | None = None,
                family: str = "llama", config: dict[str, Any] | None = None) -> Path:
    """Write config.json (with `config`'s keys over the family's), generation_config.json and
    model.safetensors; return dir."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    cfg = model_config(shape, dtype=dtype, style=config_style, family=family, overrides=config)
    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    write_json(dir / "config.json", cfg)
    write_json(dir / "generation_config.json", generation_config(cfg, family=family))
    save_tensors(dir / "model.safetensors", _model_tensors(shape, seed, family), dtype)
    return dir


# --------------------------------------------------------------------------- the example

def make_example(dir: Path, *, family: str = "llama", seed: int = 0,
                 shape: ModelShape = ModelShape(),
                 adapters: tuple[AdapterSpec, ...] | None = None,
                 dtype: str = "float32",
                 base_model_name_or_path: str | None = None,
                 config: dict[str, Any] | None = None) -> ExampleAssets:
    """Write dir/model, a checkpoint of `family` (one of `FAMILIES`) with that family's example
    tokenizer when the vocab has room for one (statesvc/tools/tokenizer.py), and
    dir/adapters/<name>/ for each adapter (default: `example_adapters(family)`);
    `base_model_name_or_path` defaults to loraplane/tiny-random-<family>; `config` replaces keys of
    the family's config.json (a preset's, statesvc/tools/presets.py)."""
    fam = _family(family)
    adapters = example_adapters(family) if adapters is None else adapters
    for a in adapters:
        outside = [m for m in a.target_modules if m not in lora_targets(family)]
        if outside:
            raise ValueError(f"adapter {a.name} targets {', '.join(outside)}: {family}'s MLP is a mixture "
                             f"of experts, and LoRA is served on its {', '.join(lora_targets(family))} only")
    names = [a.name for a in adapters]
    if len(set(names)) != len(names):
        raise ValueError("adapter names must be unique")
    for n in names:
        if not n or "/" in n or "\\" in n or n in (".", ".."):
            raise ValueError(f"adapter name {n!r} is not a valid directory name")
    shape = shaped(shape, family)
    base_name = base_model_name_or_path or f"loraplane/tiny-random-{family}"
    root = Path(dir)
    model_dir = write_model(root / "model", shape, seed=seed, dtype=dtype, family=family, config=config)
    if shape.vocab_size >= fam.tokenizer.min_vocab:
        write_tokenizer(model_dir, vocab_size=shape.vocab_size,
                        max_len=shape.max_position_embeddings, spec=fam.tokenizer)
    adapter_dirs = {
        a.name: write_adapter(root / "adapters" / a.name, a, shape, seed=seed,
                              base_model_name_or_path=base_name, dtype=dtype)
        for a in adapters}
    return ExampleAssets(root=root, model_dir=model_dir, adapter_dirs=adapter_dirs,
                         shape=shape, adapters=tuple(adapters), family=family)
