"""The example's PEFT LoRA adapters: what each is (`AdapterSpec`), the sets make_example writes
(`example_adapters`), and the writer: adapter_config.json and adapter_model.safetensors as
PEFT 0.21 (``LoraConfig.save_pretrained``) writes them, over a checkpoint's `ModelShape`
(statesvc/tools/model_shape.py)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from shared.events import lora_scaling
from shared.projections import ATTN_MODULES, MLP_MODULES, MODULE_PARENT, MODULES
from shared.modelconfig import MOE_FAMILIES
from statesvc.tools.example_files import DTYPES, normal, save_tensors, write_json
from statesvc.tools.model_shape import ModelShape

__all__ = ["EXAMPLE_ADAPTERS", "MOE_EXAMPLE_ADAPTERS", "PEFT_VERSION", "AdapterSpec",
           "adapter_config", "adapter_tensor_names", "example_adapters", "lora_targets",
           "write_adapter"]

PEFT_VERSION = "0.21.2"  # the version whose adapter files are mirrored here


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
            out[name] = normal(seed, key, (spec.r, fan_in), 1.0 / math.sqrt(fan_in))
        else:
            out[name] = normal(seed, key, (fan_out, spec.r), b_std)
    return out


def write_adapter(dir: Path, spec: AdapterSpec, shape: ModelShape, *, seed: int,
                  base_model_name_or_path: str, dtype: str = "float32") -> Path:
    """Write adapter_config.json and adapter_model.safetensors; return dir."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    for m in spec.target_modules:
        if spec.r > min(shape.module_dims(m)):
            raise ValueError(f"{spec.name}: r={spec.r} exceeds the dimensions of {m}")
    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    write_json(dir / "adapter_config.json",
               adapter_config(spec, base_model_name_or_path=base_model_name_or_path), newline=False)
    save_tensors(dir / "adapter_model.safetensors", _adapter_tensors(spec, shape, seed), dtype)
    return dir
