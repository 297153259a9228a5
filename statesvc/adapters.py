"""Validation of a PEFT LoRA directory against the pool, before anything is stored."""
from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from shared.config import MAX_ADAPTER_BYTES, MAX_CONFIG_BYTES, MODULES
from shared.events import PoolConfigured, lora_scaling
from shared.files import FileError, read_regular
from shared.peft import LoraKey, parse_lora_name
from shared.tensorfile import FLOAT_DTYPES, TensorFileError, is_finite, parse_bytes

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


class AdapterError(ValueError):
    """An adapter directory the pool cannot take; the message says what to change."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Candidate:
    """A validated adapter: its weights' bytes and the settings the event records.

    `weights` is None only when `inspect_adapter` answered from its cache of unchanged
    directories, which it does only for weights the caller said are already stored."""

    weights: bytes | None
    sha256: str
    size: int
    rank: int
    alpha: float
    use_rslora: bool
    targets: tuple[str, ...]

    @property
    def scaling(self) -> float:
        return lora_scaling(self.alpha, self.rank, self.use_rslora)


def _invalid(path: Path, what: str) -> AdapterError:
    return AdapterError("invalid_adapter", f"{path}: {what}")


def _read(path: Path, name: str, limit: int) -> bytes:
    try:
        return read_regular(path / name, limit)
    except (OSError, FileError) as exc:
        raise _invalid(path, f"cannot read {name}: {getattr(exc, 'strerror', None) or exc}") \
            from None


def _read_config(path: Path) -> dict[str, Any]:
    cfg_path = path / CONFIG_FILE
    if not cfg_path.is_file():
        raise _invalid(path, f"no {CONFIG_FILE}; point at the directory PEFT's "
                       "save_pretrained() wrote")
    try:
        cfg = json.loads(_read(path, CONFIG_FILE, MAX_CONFIG_BYTES))
    except (ValueError, RecursionError) as exc:  # bad UTF-8 or JSON, too deep, too many digits
        raise _invalid(path, f"{CONFIG_FILE} is not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise _invalid(path, f"{CONFIG_FILE} must hold a JSON object")
    return cfg


def _refuse_unsupported(path: Path, cfg: dict[str, Any]) -> None:
    def unsupported(option: str, why: str) -> AdapterError:
        return AdapterError("unsupported", f"{path}: {option} is not supported yet ({why}); "
                            "train or export the adapter without it")

    if cfg.get("peft_type") != "LORA":
        raise _invalid(path, f"peft_type is {cfg.get('peft_type')!r}; only LORA adapters are "
                       "supported")
    if cfg.get("use_dora"):
        raise unsupported("use_dora (DoRA)", "it needs a magnitude vector per module")
    if cfg.get("modules_to_save"):
        raise unsupported("modules_to_save", f"it saves whole modules {cfg['modules_to_save']}")
    for pattern in ("rank_pattern", "alpha_pattern"):
        if cfg.get(pattern):
            raise unsupported(f"a non-empty {pattern}", "every module must share r and lora_alpha")
    if cfg.get("trainable_token_indices") or (path / "added_tokens.json").exists():
        raise unsupported("added tokens", "the base model's vocabulary is fixed")
    if cfg.get("bias", "none") != "none" or cfg.get("lora_bias"):
        raise unsupported(f"bias={cfg.get('bias')!r}", "LoRA modules carry no bias here")
    if cfg.get("fan_in_fan_out"):
        raise unsupported("fan_in_fan_out", "Llama's linear layers are not Conv1D")
    if cfg.get("layer_replication"):
        raise unsupported("layer_replication", "the base model's layers are fixed")


def _rank_alpha(path: Path, cfg: dict[str, Any], pool: PoolConfigured) -> tuple[int, float]:
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if type(r) is not int or r < 1:
        raise _invalid(path, f"r must be a positive integer, got {r!r}")
    alpha_f = _as_float(alpha)
    if alpha_f is None or not math.isfinite(alpha_f) or alpha_f <= 0:
        raise _invalid(path, f"lora_alpha must be a positive number, got {alpha!r}")
    if r > pool.max_rank:
        raise AdapterError("invalid_adapter", f"{path}: rank {r} is above the pool's --max-rank "
                           f"{pool.max_rank}; configure a new pool with a larger --max-rank, or "
                           "retrain the adapter with a smaller r")
    return r, alpha_f


def _as_float(value: Any) -> float | None:
    """A JSON number as a float (inf beyond float's range); None for anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return float(value)
    except OverflowError:  # an int of 309 digits or more
        return math.inf


def _read_weights(path: Path, max_bytes: int) -> bytes:
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        if (path / "adapter_model.bin").exists():
            raise AdapterError("unsupported", f"{path}: adapter_model.bin is a pickle file and "
                               "pickle files are refused; save the adapter with "
                               "save_pretrained(..., safe_serialization=True) to get "
                               f"{WEIGHTS_FILE}")
        raise _invalid(path, f"no {WEIGHTS_FILE}")
    return _read(path, WEIGHTS_FILE, max_bytes)


def _check_tensors(path: Path, data: bytes, pool: PoolConfigured, rank: int) -> tuple[str, ...]:
    try:
        header = parse_bytes(data)
    except TensorFileError as exc:
        raise _invalid(path, f"{WEIGHTS_FILE}: {exc}") from None
    if not header.tensors:
        raise _invalid(path, f"{WEIGHTS_FILE} holds no tensors")
    keys: dict[LoraKey, str] = {}
    for name, info in sorted(header.tensors.items()):
        key = parse_lora_name(name)
        if key is None:
            if "embed_tokens" in name or "lm_head" in name:
                raise AdapterError("unsupported", f"{path}: tensor {name!r} trains token "
                                   "embeddings (added tokens); this is not supported yet")
            raise _invalid(path, f"tensor {name!r} is not a LoRA weight of a Llama layer; "
                           "expected names like base_model.model.model.layers.0.self_attn."
                           "q_proj.lora_A.weight")
        if key.layer >= pool.num_layers:
            raise _invalid(path, f"tensor {name!r} is for layer {key.layer}, but the base model "
                           f"has {pool.num_layers} layers")
        if key.module not in pool.targets:
            raise _invalid(path, f"tensor {name!r} targets {key.module}, which the pool does not "
                           f"hold (pool targets: {', '.join(pool.targets)}); configure a pool "
                           "with --targets including it")
        if info.dtype not in FLOAT_DTYPES:
            raise _invalid(path, f"tensor {name!r} has dtype {info.dtype}; use F32, F16 or BF16")
        in_f, out_f = pool.module_dims[key.module]
        want = (rank, in_f) if key.matrix == "A" else (out_f, rank)
        if info.shape != want:
            raise _invalid(path, f"tensor {name!r} has shape {list(info.shape)}, expected "
                           f"{list(want)} (r={rank}, {key.module} is {in_f} -> {out_f})")
        if not is_finite(data, header, info):
            raise _invalid(path, f"tensor {name!r} contains NaN or Inf values")
        keys[key] = name
    for key, name in keys.items():
        other = LoraKey(key.layer, key.module, "B" if key.matrix == "A" else "A")
        if other not in keys:
            raise _invalid(path, f"tensor {name!r} has no matching lora_{other.matrix}")
    return tuple(m for m in MODULES if any(k.module == m for k in keys))


def inspect_adapter(path: Path, pool: PoolConfigured, *, max_bytes: int = MAX_ADAPTER_BYTES,
                    stored: Callable[[str], bool] | None = None) -> Candidate:
    """Validate a PEFT LoRA directory for `pool`; raises AdapterError saying what to fix.

    With `stored` (is a blob with this sha256 already kept?), a directory inspected before
    and unchanged since, whose weights are stored, is answered without reading it again
    (the rule is at `_SEEN`)."""
    path = Path(path)
    if stored is None:
        return _inspect(path, pool, max_bytes)
    key = (str(path), pool.fingerprint, pool.targets, pool.num_layers, pool.max_rank, max_bytes)
    started = time.time_ns()
    stats = _stats(path)
    seen = _SEEN.get(key)
    if seen is not None and stats is not None and seen[0] == stats and stored(seen[1].sha256):
        _SEEN.move_to_end(key)
        return seen[1]
    cand = _inspect(path, pool, max_bytes)
    if stats is not None and _settled(stats, started):
        _SEEN[key] = (stats, replace(cand, weights=None))
        _SEEN.move_to_end(key)
        if len(_SEEN) > _SEEN_MAX:
            _SEEN.popitem(last=False)
    return cand


def _inspect(path: Path, pool: PoolConfigured, max_bytes: int) -> Candidate:
    if not os.path.isdir(path):  # Path.is_dir raises on ENAMETOOLONG and EACCES (3.11)
        raise _invalid(path, "no such directory")
    cfg = _read_config(path)
    _refuse_unsupported(path, cfg)
    rank, alpha = _rank_alpha(path, cfg, pool)
    declared = cfg.get("target_modules")
    if isinstance(declared, list):
        outside = [m for m in declared if m not in pool.targets]
        if outside:
            raise _invalid(path, f"target_modules {outside} are not among the pool's targets "
                           f"({', '.join(pool.targets)}); configure a pool with --targets "
                           "including them")
    data = _read_weights(path, max_bytes)
    sha256 = hashlib.sha256(data).hexdigest()
    targets = _checked_targets(path, data, sha256, pool, rank)
    if isinstance(declared, list) and not set(targets) <= set(declared):
        raise _invalid(path, f"weights target {list(targets)}, but target_modules lists only "
                       f"{declared}")
    use_rslora = cfg.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise _invalid(path, f"use_rslora must be true or false, got {use_rslora!r}")
    return Candidate(data, sha256, len(data), rank, alpha, use_rslora, targets)


# Directories inspected before, by path and pool: the stat of the directory and of its two
# files taken before that inspection read them, and its verdict (without the bytes).
#
# The rule: an answer is reused only while all three stats are identical (device, inode,
# size, mtime, ctime, mode) and were already settled when they were taken: every ctime and
# mtime at least RACY_NS older than the inspection that read them. Any later change to a
# file (a write, truncate, rename over it, chmod, touch) sets its ctime to the time of the
# change, which then differs from the settled one, so a changed file is read and hashed
# again, never served under its old sha256; the settling rules out a change within the
# filesystem's timestamp granularity of the one before ("racy git"). Adding a file such as
# added_tokens.json changes the directory's mtime. The rule trusts the clock and the
# filesystem's ctime: a clock set back by more than RACY_NS, or a network mount that serves
# stale attributes or stamps times by a clock behind this host's, can defeat it.
RACY_NS = 2_000_000_000
_Stats = tuple[tuple[int, ...], ...]
_SEEN: OrderedDict[tuple[Any, ...], tuple[_Stats, Candidate]] = OrderedDict()
_SEEN_MAX = 4096


def _stats(path: Path) -> _Stats | None:
    try:
        base = str(path)
        sts = [os.stat(base), os.stat(os.path.join(base, CONFIG_FILE)),
               os.stat(os.path.join(base, WEIGHTS_FILE))]
    except (OSError, ValueError):
        return None
    return tuple((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode)
                 for st in sts)


def _settled(stats: _Stats, started_ns: int) -> bool:
    return all(st[4] < started_ns - RACY_NS and st[3] < started_ns - RACY_NS for st in stats)


# Verdicts of _check_tensors for weights already checked, by content: the same bytes
# checked for the same pool and rank always pass the same way, so a reload of a known
# adapter costs one read and one hash, not a scan of every tensor.
_CHECKED: OrderedDict[tuple[str, str, tuple[str, ...], int, int], tuple[str, ...]] = OrderedDict()
_CHECKED_MAX = 4096


def _checked_targets(path: Path, data: bytes, sha256: str, pool: PoolConfigured,
                     rank: int) -> tuple[str, ...]:
    key = (sha256, pool.fingerprint, pool.targets, pool.num_layers, rank)
    targets = _CHECKED.get(key)
    if targets is None:
        targets = _check_tensors(path, data, pool, rank)
        _CHECKED[key] = targets
        if len(_CHECKED) > _CHECKED_MAX:
            _CHECKED.popitem(last=False)
    else:
        _CHECKED.move_to_end(key)
    return targets
