"""The base model's fingerprint: its config.json and its tensors' names, shapes and dtypes.

The pool is configured for one base model; every replica checks that the
model it was given has the same fingerprint before it serves.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.canonical import digest
from shared.checkpoint import shard_paths
from shared.config import MAX_CONFIG_BYTES
from shared.files import read_regular
from shared.modelconfig import ModelConfigError, check_recordable, check_tensors, read_architecture
from shared.tensorfile import TensorFileError, read_header


class ModelError(ValueError):
    """The directory is not a usable Hugging Face Llama checkpoint."""


@dataclass(frozen=True)
class ModelInfo:
    fingerprint: str                                # sha256 hex
    config: dict[str, Any]                          # config.json as read
    num_layers: int
    module_dims: dict[str, tuple[int, int]]         # module -> (in_features, out_features)
    tensors: dict[str, tuple[tuple[int, ...], str]]  # name -> (shape, dtype)


def read_model(model_dir: Path) -> ModelInfo:
    """Read config.json and the safetensors headers (not the weights) of a checkpoint."""
    try:
        return _read_model(Path(model_dir))
    except ModelError:
        raise
    except (OSError, ValueError, TypeError, AttributeError, OverflowError,
            RecursionError) as exc:  # FileError is a ValueError
        raise ModelError(f"{model_dir}: not a readable Hugging Face checkpoint ({exc})") from None


def _read_model(model_dir: Path) -> ModelInfo:
    if not model_dir.is_dir():
        raise ModelError(f"{model_dir}: not a directory")
    config_path = model_dir / "config.json"
    try:
        config = json.loads(read_regular(config_path, MAX_CONFIG_BYTES))
    except FileNotFoundError:
        raise ModelError(f"{model_dir}: no config.json") from None
    except json.JSONDecodeError as exc:
        raise ModelError(f"{model_dir}/config.json: invalid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ModelError(f"{model_dir}/config.json: must hold a JSON object")
    try:  # what no replica can serve, in the words a replica start uses (computed/model/loader.py)
        check_recordable(config)
        arch = read_architecture(config)
    except ModelConfigError as exc:
        raise ModelError(f"{model_dir}/{exc}") from None
    try:
        shards = shard_paths(model_dir)
    except ModelConfigError as exc:
        raise ModelError(str(exc)) from None
    tensors: dict[str, tuple[tuple[int, ...], str]] = {}
    for shard in shards:
        try:
            header = read_header(shard)
        except (OSError, TensorFileError) as exc:
            raise ModelError(f"{shard}: {exc}") from None
        for name, info in header.tensors.items():
            tensors[name] = (info.shape, info.dtype)
    try:
        check_tensors(arch, {name: shape for name, (shape, _) in tensors.items()})
    except ModelConfigError as exc:
        raise ModelError(f"{model_dir}: {exc}") from None
    num_layers, module_dims = arch.num_layers, arch.module_dims
    fingerprint = digest({"config": config,
                          "tensors": sorted([n, list(s), d] for n, (s, d) in tensors.items())})
    return ModelInfo(fingerprint, config, num_layers, module_dims, tensors)
