"""Where a Hugging Face checkpoint keeps its tensors: the safetensors files of a model directory.

One listing for the fingerprint `pool init` records (shared/fingerprint.py) and the model a
replica loads (computed/model/loader.py), so both read the same files and refuse the same
directories, with the same words.
"""
from __future__ import annotations

import json
from pathlib import Path

from shared.config import MAX_CONFIG_BYTES
from shared.files import read_regular
from shared.modelconfig import ModelConfigError


def shard_paths(model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors files: `model.safetensors`, or the shards its index names (each a
    file in the same directory). ModelConfigError saying why where there are none."""
    single = model_dir / "model.safetensors"
    index = model_dir / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            weight_map = json.loads(read_regular(index, MAX_CONFIG_BYTES))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise ModelConfigError(f"{index}: not a valid safetensors index ({exc})") from None
        for n in names:
            if not isinstance(n, str) or "/" in n or "\\" in n or n.startswith("."):
                raise ModelConfigError(f"{index}: shard name {n!r} must be a file in the same directory")
        return [model_dir / n for n in names]
    if any(model_dir.glob("*.bin")):
        raise ModelConfigError(f"{model_dir}: only pickle .bin weights found; save the model with "
                               "safe_serialization=True to get model.safetensors")
    raise ModelConfigError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")
