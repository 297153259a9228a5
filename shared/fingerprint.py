"""The base model's fingerprint: its config.json and its tensors' names, shapes and dtypes;
and the digest of its weights.

The pool is configured for one base model; every replica checks that the
model it was given has the same fingerprint before it serves. The fingerprint reads headers
only, so two checkpoints of one architecture (a base model and its instruct fine-tune, the
same model saved with other weights) share it: `pool init` also records `weights_digest`, the
sha256 of the tensors' bytes, and a serving replica checks that too (computed/cli.py; a
replica keeps its own digest beside the shards' stat, `cached_weights_digest`).
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from shared.canonical import digest
from shared.checkpoint import shard_paths
from shared.config import MAX_CONFIG_BYTES
from shared.files import open_regular, read_regular
from shared.modelconfig import ModelConfigError, check_recordable, check_tensors, read_architecture
from shared.tensorfile import TensorFileError, read_header, read_header_of

HASH_CHUNK = 8 << 20  # tensor bytes hashed at a time; `progress` between chunks


class ModelError(ValueError):
    """The directory is not a usable Hugging Face checkpoint of a served family."""


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


def weights_digest(model_dir: Path, *, progress: Callable[[], None] = lambda: None) -> str:
    """sha256 over every tensor of the checkpoint in name order: for each, its name, dtype and
    shape (length-prefixed JSON), then its bytes. How the tensors are split over shards does
    not change it. ModelError when a shard cannot be read."""
    try:
        return _weights_digest(Path(model_dir), progress)
    except (OSError, ValueError, TensorFileError, ModelConfigError) as exc:
        raise ModelError(f"{model_dir}: the weights could not be read ({exc})") from None


def _weights_digest(model_dir: Path, progress: Callable[[], None]) -> str:
    files = [open_regular(shard) for shard in shard_paths(model_dir)]
    try:
        where = sorted((name, i, header.data_start, info)
                       for i, f in enumerate(files)
                       for header in (read_header_of(f),)
                       for name, info in header.tensors.items())
        h = hashlib.sha256()
        for name, i, data_start, info in where:
            tag = json.dumps([name, info.dtype, list(info.shape)]).encode()
            h.update(struct.pack("<Q", len(tag)) + tag)
            fd, at, end = files[i].fileno(), data_start + info.start, data_start + info.end
            while at < end:
                chunk = os.pread(fd, min(HASH_CHUNK, end - at), at)
                if not chunk:
                    raise ModelError(f"{model_dir}: shard {i} ends inside tensor {name!r}")
                h.update(chunk)
                at += len(chunk)
                progress()
        return h.hexdigest()
    finally:
        for f in files:
            f.close()


def _shard_stats(model_dir: Path) -> list[list[int | str]]:
    """What changes when a shard is rewritten: its name, device, inode, size, mtime, ctime."""
    out: list[list[int | str]] = []
    for shard in shard_paths(model_dir):
        st = os.stat(shard)
        out.append([str(shard.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns,
                    st.st_ctime_ns])
    return out


def cached_weights_digest(model_dir: Path, cache_file: Path) -> str:
    """`weights_digest`, kept in `cache_file` beside the shards' stat (path, inode, size, mtime,
    ctime) and computed again only when one changed: a replica's restart does not read a
    large checkpoint twice. A cache that cannot be read or written is ignored."""
    try:
        stats = _shard_stats(Path(model_dir))
    except (OSError, ModelConfigError) as exc:
        raise ModelError(f"{model_dir}: the weights could not be read ({exc})") from None
    try:
        saved = json.loads(cache_file.read_text())
        if saved.get("shards") == stats and isinstance(saved.get("digest"), str):
            return str(saved["digest"])
    except (OSError, ValueError, AttributeError):
        pass
    digest_ = weights_digest(model_dir)
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"shards": stats, "digest": digest_}))
        tmp.replace(cache_file)
    except OSError:
        pass
    return digest_
