"""A tiny random checkpoint of any served family and PEFT LoRA adapters, written as HF writes them.

Only numpy, json and ``safetensors.numpy`` are used (no torch, jax or
transformers), so the state service can build example assets by itself.
The layouts mirror what transformers 5.24 (``save_pretrained``) and PEFT 0.21
(``LoraConfig.save_pretrained``) write; the checkpoint config also carries the
transformers 4.x keys (``torch_dtype``, ``rope_theta``, ``rope_scaling``) unless
asked otherwise, and both major versions load it.

Every tensor is drawn from its own ``numpy.random.Generator`` seeded by
``(seed, sha256(name))``, so the same seed gives byte-identical files.

A family other than Llama is its entry in `FAMILIES`: what its config.json adds, replaces or
lacks against Llama's, what its decoder layers hold against Llama's, where its norm weights
sit, and its tokenizer (statesvc/tools/tokenizer.py `TOKENIZERS`). Those configs are written as
transformers 5 writes them (``config_style="v5"``; only Llama also carries the 4.x keys).
"""
from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from safetensors.numpy import save_file

from shared.events import lora_scaling
from shared.llama import ATTN_MODULES, MLP_MODULES, MODULE_PARENT, MODULES, module_dims
from shared.modelconfig import MOE_FAMILIES
from statesvc.tools.families import FAMILIES, INITS, Family
from statesvc.tools.families import family as _family
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

Dtype = Literal["float32", "bfloat16"]
ConfigStyle = Literal["both", "v5", "v4"]

# The versions whose on-disk layouts are mirrored here.
TRANSFORMERS_VERSION = "5.24.0"
TRANSFORMERS_V4_VERSION = "4.46.3"
PEFT_VERSION = "0.21.2"
EXAMPLE_BASE_MODEL_NAME = "loraplane/tiny-random-llama"

_ST_DTYPES: dict[str, str] = {"float32": "F32", "bfloat16": "BF16"}


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a checkpoint (the fields LlamaConfig takes; a family's own options come
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


@dataclass(frozen=True)
class AdapterSpec:
    """One LoRA adapter: its name, rank, alpha and target modules."""

    name: str
    r: int
    lora_alpha: float
    target_modules: tuple[str, ...]
    use_rslora: bool = False

    def __post_init__(self) -> None:
        if self.r <= 0:
            raise ValueError("r must be positive")
        if not self.target_modules:
            raise ValueError("target_modules must not be empty")
        unknown = set(self.target_modules) - set(MODULES)
        if unknown:
            raise ValueError(f"unknown target modules {sorted(unknown)}")
        if len(set(self.target_modules)) != len(self.target_modules):
            raise ValueError("target_modules has duplicates")

    @property
    def scaling(self) -> float:
        """The factor PEFT multiplies B @ A by: alpha/sqrt(r) with rsLoRA, else alpha/r."""
        return lora_scaling(self.lora_alpha, self.r, self.use_rslora)


EXAMPLE_ADAPTERS: tuple[AdapterSpec, ...] = (
    AdapterSpec("attn-qv-r8", r=8, lora_alpha=16, target_modules=("q_proj", "v_proj")),
    AdapterSpec("attn-all-r4", r=4, lora_alpha=4, target_modules=ATTN_MODULES),
    AdapterSpec("mlp-only-r16", r=16, lora_alpha=32, target_modules=MLP_MODULES),
    AdapterSpec("all-r32-rslora", r=32, lora_alpha=16, target_modules=MODULES, use_rslora=True),
    AdapterSpec("all-r2", r=2, lora_alpha=8, target_modules=MODULES),
)
# A mixture of experts takes LoRA on attention only (docs/adapters.md): EXAMPLE_ADAPTERS' ranks,
# alphas and rsLoRA, each on attention
MOE_EXAMPLE_ADAPTERS: tuple[AdapterSpec, ...] = (
    *EXAMPLE_ADAPTERS[:2],  # attn-qv-r8, attn-all-r4
    AdapterSpec("attn-ko-r16", r=16, lora_alpha=32, target_modules=("k_proj", "o_proj")),
    AdapterSpec("attn-all-r32-rslora", r=32, lora_alpha=16, target_modules=ATTN_MODULES, use_rslora=True),
    AdapterSpec("attn-all-r2", r=2, lora_alpha=8, target_modules=ATTN_MODULES),
)


def lora_targets(family: str) -> tuple[str, ...]:
    """The modules a replica serves LoRA on in `family`: the seven, or a mixture of experts'
    attention projections."""
    return ATTN_MODULES if family in MOE_FAMILIES else MODULES


def example_adapters(family: str = "llama") -> tuple[AdapterSpec, ...]:
    """The adapters make_example writes for `family` unless told: EXAMPLE_ADAPTERS, or a mixture
    of experts' MOE_EXAMPLE_ADAPTERS (in the same order, of the same ranks)."""
    return MOE_EXAMPLE_ADAPTERS if family in MOE_FAMILIES else EXAMPLE_ADAPTERS


@dataclass(frozen=True)
class ExampleAssets:
    """Where make_example put things."""

    root: Path
    model_dir: Path
    adapter_dirs: dict[str, Path]
    shape: ModelShape  # as written (`shaped`: a Gemma example's embeddings are tied)
    adapters: tuple[AdapterSpec, ...]
    family: str = "llama"


# --------------------------------------------------------------------------- helpers

def _rng(seed: int, *names: str) -> np.random.Generator:
    """A generator keyed by the seed and a stable hash of the names."""
    digest = hashlib.sha256("\x00".join(names).encode()).digest()
    return np.random.default_rng([seed, int.from_bytes(digest[:8], "little")])


def _normal(seed: int, names: tuple[str, ...], shape: tuple[int, ...], std: float) -> npt.NDArray[np.float32]:
    out: npt.NDArray[np.float32] = _rng(seed, *names).standard_normal(shape, dtype=np.float32)
    out *= np.float32(std)
    return out


def _to_bf16_bits(x: npt.NDArray[np.float32]) -> npt.NDArray[np.uint16]:
    """Round float32 to bfloat16 (nearest, ties to even) and return the raw bits."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits += 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).astype(np.uint16)


def encode_safetensors(tensors: dict[str, tuple[str, tuple[int, ...], bytes]],
                       metadata: dict[str, str] | None = None) -> bytes:
    """Serialize (dtype, shape, little-endian bytes) entries as the reference writer does.

    8-byte little-endian header length, compact JSON header (``__metadata__``
    first, then tensors in name order) padded with spaces to a multiple of 8,
    then the data in the same order.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"} if metadata is None else metadata}
    offset = 0
    for name in sorted(tensors):
        st_dtype, shape, blob = tensors[name]
        header[name] = {"dtype": st_dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return b"".join([struct.pack("<Q", len(head)), head] + [tensors[n][2] for n in sorted(tensors)])


def write_safetensors(path: Path, tensors: dict[str, npt.NDArray[Any]], *,
                      dtype: Dtype = "float32", metadata: dict[str, str] | None = None) -> None:
    """Write float32 arrays, or bfloat16 given as uint16 bit patterns, to a safetensors file.

    float32 goes through ``safetensors.numpy.save_file``; bfloat16, which numpy
    and ``safetensors.numpy`` lack, through :func:`encode_safetensors`.
    """
    meta = {"format": "pt"} if metadata is None else metadata
    if dtype == "float32":
        save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()},
                  str(path), metadata=meta)
        return
    if dtype != "bfloat16":
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    entries: dict[str, tuple[str, tuple[int, ...], bytes]] = {}
    for name, arr in tensors.items():
        if arr.dtype != np.uint16:
            raise TypeError(f"{name}: bfloat16 tensors must be given as uint16 bit patterns")
        entries[name] = ("BF16", tuple(arr.shape), np.ascontiguousarray(arr, dtype="<u2").tobytes())
    Path(path).write_bytes(encode_safetensors(entries, meta))


def _save(path: Path, tensors: dict[str, npt.NDArray[np.float32]], dtype: str) -> None:
    if dtype == "float32":
        write_safetensors(path, tensors, dtype="float32")
    elif dtype == "bfloat16":
        write_safetensors(path, {k: _to_bf16_bits(v) for k, v in tensors.items()}, dtype="bfloat16")
    else:
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")


def _write_json(path: Path, obj: dict[str, Any], *, newline: bool = True) -> None:
    # transformers and PEFT both write sorted keys and indent 2; only transformers
    # ends the file with a newline.
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + ("\n" if newline else ""))


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
            norm = _normal(seed, key, dims, 0.1)
            norm += center
            out[name] = norm
        elif init == "embed":
            scale = _family(family).input_scale(shape) if name == "model.embed_tokens.weight" else 1.0
            out[name] = _normal(seed, key, dims, emb_std / scale)
        elif init == "linear":
            # torch Linear layout [out, in]; std 1/sqrt(fan_in) keeps activations O(1).
            out[name] = _normal(seed, key, dims, 1.0 / math.sqrt(dims[-1]))
        elif init == "bias":
            out[name] = _normal(seed, key, dims, 0.2)
        else:
            raise ValueError(f"{name}: unknown init {init!r}; expected one of {', '.join(INITS)}")
    return out


def model_config(shape: ModelShape, *, dtype: str = "float32", style: ConfigStyle | None = None,
                 family: str = "llama") -> dict[str, Any]:
    """The config.json transformers writes for the family's ``*ForCausalLM`` of this shape.

    ``style``: "v5" is what transformers 5 writes (``dtype``, ``rope_parameters``),
    "v4" what 4.x writes (``torch_dtype``, ``rope_theta``, ``rope_scaling``),
    "both" carries both sets of keys (Llama's default; each version reads it). Families
    other than Llama are written as transformers 5 writes them ("v5", their default).
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
                family: str = "llama") -> Path:
    """Write config.json, generation_config.json and model.safetensors; return dir."""
    if dtype not in _ST_DTYPES:
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    cfg = model_config(shape, dtype=dtype, style=config_style, family=family)
    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    _write_json(dir / "config.json", cfg)
    _write_json(dir / "generation_config.json", generation_config(cfg, family=family))
    _save(dir / "model.safetensors", _model_tensors(shape, seed, family), dtype)
    return dir


# --------------------------------------------------------------------------- adapters

def adapter_tensor_names(spec: AdapterSpec, shape: ModelShape) -> list[str]:
    """The PEFT tensor names of an adapter, sorted."""
    return sorted(
        f"base_model.model.model.layers.{i}.{MODULE_PARENT[m]}.{m}.lora_{ab}.weight"
        for i in range(shape.num_hidden_layers) for m in spec.target_modules for ab in "AB")


def adapter_config(spec: AdapterSpec, *, base_model_name_or_path: str) -> dict[str, Any]:
    """The adapter_config.json PEFT 0.21 writes for this spec."""
    alpha: float | int = int(spec.lora_alpha) if float(spec.lora_alpha).is_integer() else spec.lora_alpha
    return {
        "alora_invocation_tokens": None,
        "alpha_pattern": {},
        "arrow_config": None,
        "auto_mapping": None,
        "base_model_name_or_path": base_model_name_or_path,
        "bias": "none",
        "corda_config": None,
        "ensure_weight_tying": False,
        "eva_config": None,
        "exclude_modules": None,
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "kasa_config": None,
        "layer_replication": None,
        "layers_pattern": None,
        "layers_to_transform": None,
        "loftq_config": {},
        "lora_alpha": alpha,
        "lora_bias": False,
        "lora_dropout": 0.0,
        "lora_ga_config": None,
        "megatron_config": None,
        "megatron_core": "megatron.core",
        "modules_to_save": None,
        "monteclora_config": None,
        "peft_type": "LORA",
        "peft_version": PEFT_VERSION,
        "qalora_group_size": 16,
        "r": spec.r,
        "rank_pattern": {},
        "revision": None,
        "target_modules": sorted(spec.target_modules),
        "target_parameters": None,
        "task_type": "CAUSAL_LM",
        "trainable_token_indices": None,
        "use_bdlora": None,
        "use_dora": False,
        "use_qalora": False,
        "use_rslora": spec.use_rslora,
        "velora_config": None,
    }


def _adapter_tensors(spec: AdapterSpec, shape: ModelShape, seed: int) -> dict[str, npt.NDArray[np.float32]]:
    # A ~ N(0, 1/in) so A @ x has unit RMS per rank; B is scaled so that
    # scaling * B @ A @ x has RMS ~0.2 whatever r and alpha are: a visible change.
    b_std = 0.2 / (math.sqrt(spec.r) * spec.scaling)
    out: dict[str, npt.NDArray[np.float32]] = {}
    for name in adapter_tensor_names(spec, shape):
        fan_in, fan_out = shape.module_dims(name.split(".")[-3])
        key = ("adapter", spec.name, name)
        if ".lora_A." in name:
            out[name] = _normal(seed, key, (spec.r, fan_in), 1.0 / math.sqrt(fan_in))
        else:
            out[name] = _normal(seed, key, (fan_out, spec.r), b_std)
    return out


def write_adapter(dir: Path, spec: AdapterSpec, shape: ModelShape, *, seed: int,
                  base_model_name_or_path: str, dtype: str = "float32") -> Path:
    """Write adapter_config.json and adapter_model.safetensors; return dir."""
    if dtype not in _ST_DTYPES:
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    for m in spec.target_modules:
        if spec.r > min(shape.module_dims(m)):
            raise ValueError(f"{spec.name}: r={spec.r} exceeds the dimensions of {m}")
    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    _write_json(dir / "adapter_config.json",
                adapter_config(spec, base_model_name_or_path=base_model_name_or_path), newline=False)
    _save(dir / "adapter_model.safetensors", _adapter_tensors(spec, shape, seed), dtype)
    return dir


def make_example(dir: Path, *, family: str = "llama", seed: int = 0,
                 shape: ModelShape = ModelShape(),
                 adapters: tuple[AdapterSpec, ...] | None = None,
                 dtype: str = "float32",
                 base_model_name_or_path: str | None = None) -> ExampleAssets:
    """Write dir/model, a checkpoint of `family` (one of `FAMILIES`) with that family's example
    tokenizer when the vocab has room for one (statesvc/tools/tokenizer.py), and
    dir/adapters/<name>/ for each adapter (default: `example_adapters(family)`);
    `base_model_name_or_path` defaults to loraplane/tiny-random-<family>."""
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
    model_dir = write_model(root / "model", shape, seed=seed, dtype=dtype, family=family)
    if shape.vocab_size >= fam.tokenizer.min_vocab:
        write_tokenizer(model_dir, vocab_size=shape.vocab_size,
                        max_len=shape.max_position_embeddings, spec=fam.tokenizer)
    adapter_dirs = {
        a.name: write_adapter(root / "adapters" / a.name, a, shape, seed=seed,
                              base_model_name_or_path=base_name, dtype=dtype)
        for a in adapters}
    return ExampleAssets(root=root, model_dir=model_dir, adapter_dirs=adapter_dirs,
                         shape=shape, adapters=tuple(adapters), family=family)
