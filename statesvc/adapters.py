"""Validation of a PEFT LoRA directory against the pool, before anything is stored."""
from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO, Callable, cast

from shared.config import MAX_ADAPTER_BYTES, MAX_CONFIG_BYTES, POOL_DTYPE_MAX
from shared.errors import CodedError
from shared.events import AdapterLoaded, PoolConfigured, lora_scaling
from shared.files import Beneath, FileError, OutsideRoots, read_limited
from shared.projections import ATTN_MODULES, MODULES
from shared.modelconfig import MOE_FAMILIES
from shared.peft import LoraKey, parse_lora_name
from shared.tensorfile import (FLOAT_DTYPES, Header, TensorFileError, is_finite,
                               read_header_of)
from statesvc.peft_config import (ConfigRefused, alpha_problem, brief_repr, refuse_unsupported,
                                  resolve_targets, unloaded_is_zero)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ANYWHERE = (Path("/"),)  # the roots when statesvc runs without --adapter-root
READ_CHUNK = 8 << 20  # weights are read and hashed this much at a time, `progress` between


class AdapterError(CodedError, ValueError):
    """An adapter directory the pool cannot take; the message says what to change."""


@dataclass(frozen=True)
class Candidate:
    """A validated adapter: its weights' bytes and the settings the event records.

    `weights` is None only when `inspect_adapter` answered from its cache of unchanged
    directories, which it does only for weights the caller said are already stored."""

    weights: bytearray | None
    sha256: str
    size: int
    rank: int
    alpha: float
    use_rslora: bool
    targets: tuple[str, ...]

    @property
    def scaling(self) -> float:
        return lora_scaling(self.alpha, self.rank, self.use_rslora)


FIELD = "args.path"  # what every refusal of an adapter directory names


def _invalid(path: Path, what: str) -> AdapterError:
    return AdapterError("invalid_adapter", f"{path}: {what}", FIELD)


class _Opened:
    """An adapter directory and its two files, each opened once beneath the roots: every
    check and every read uses these handles, so what is read is what was checked. A file
    that is missing is None; one that cannot be opened is the error that using it raises.

    Each file must be a regular file inside the directory itself (a symlink is followed only
    to a target inside it): without --adapter-root statesvc reads whatever its user may, and
    a weights file linking to /etc/shadow had its first bytes quoted back as a header
    length. With --adapter-root the roots confine the files instead, so a Hugging Face
    cache's snapshot links to ../../blobs keep working."""

    def __init__(self, path: Path, roots: tuple[Path, ...]) -> None:
        self.path = path
        try:
            self.fd, real = Beneath(roots).open_dir(path)
        except OutsideRoots as exc:
            raise _outside(path, exc.resolved, roots) from None
        except OSError as exc:
            missing = exc.errno in (errno.ENOENT, errno.ENOTDIR)
            raise _invalid(path, "no such directory" if missing else
                           f"cannot open the directory: {exc.strerror or exc}") from None
        inside = Beneath(roots if roots != ANYWHERE else (real,))
        self.files: dict[str, BinaryIO | AdapterError | None] = {}
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            try:
                self.files[name] = inside.open_file(self.fd, real, name)
            except OutsideRoots as exc:
                self.close()
                if roots != ANYWHERE:
                    raise _outside(path / name, exc.resolved, roots) from None
                raise AdapterError("forbidden", f"{path}: {name} is a symlink to "
                                   f"{exc.resolved}, outside the adapter directory; statesvc "
                                   f"reads an adapter's files from inside its directory "
                                   f"only: copy the file in, or run statesvc with an "
                                   f"--adapter-root holding both", FIELD) from None
            except FileNotFoundError:
                self.files[name] = None
            except (OSError, FileError) as exc:
                self.files[name] = _invalid(path, f"cannot read {name}: "
                                            f"{getattr(exc, 'strerror', None) or exc}")

    def file(self, name: str) -> BinaryIO | None:
        f = self.files[name]
        if isinstance(f, AdapterError):
            raise f
        return f

    def has(self, name: str) -> bool:
        """Whether the directory holds an entry `name`, of any kind."""
        try:
            os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except OSError:
            return False
        return True

    def _open_files(self) -> list[BinaryIO]:
        return [f for f in self.files.values()
                if f is not None and not isinstance(f, AdapterError)]

    def stats(self) -> _Stats | None:
        """The stat of the directory and of its two files, from their handles."""
        fds = [self.fd] + [f.fileno() for f in self._open_files()]
        if len(fds) != 3:
            return None
        return tuple((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns,
                      st.st_mode) for st in map(os.fstat, fds))

    def close(self) -> None:
        for f in self._open_files():
            f.close()
        os.close(self.fd)

    def __enter__(self) -> _Opened:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _outside(path: Path, resolved: Path, roots: tuple[Path, ...]) -> AdapterError:
    via = "" if resolved == path else f" (it resolves to {resolved})"
    return AdapterError("forbidden", f"{path} is outside the adapter roots{via}; statesvc "
                        f"loads only from under {', '.join(map(str, roots))} (--adapter-root)",
                        FIELD)


def _read_config(d: _Opened) -> dict[str, Any]:
    path, f = d.path, d.file(CONFIG_FILE)
    if f is None:
        raise _invalid(path, f"no {CONFIG_FILE}; point at the directory PEFT's "
                       "save_pretrained() wrote")
    try:
        raw = read_limited(f, MAX_CONFIG_BYTES, path / CONFIG_FILE)
    except (OSError, FileError) as exc:
        raise _invalid(path, f"cannot read {CONFIG_FILE}: "
                       f"{getattr(exc, 'strerror', None) or exc}") from None
    try:
        cfg = json.loads(raw)
    except UnicodeDecodeError as exc:  # its message quotes the byte: never echo what was read
        raise _invalid(path, f"{CONFIG_FILE} is not valid JSON (not UTF-8 text at byte "
                       f"{exc.start})") from None
    except (ValueError, RecursionError) as exc:  # bad JSON, too deep, too many digits
        raise _invalid(path, f"{CONFIG_FILE} is not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise _invalid(path, f"{CONFIG_FILE} must hold a JSON object")
    return cfg


def _refuse_unsupported(d: _Opened, cfg: dict[str, Any], pool: PoolConfigured) -> None:
    """Every option that changes what PEFT computes and the pool cannot serve (statesvc/peft_config.py)."""
    base_has_bias = bool(pool.model_config.get("attention_bias") or pool.model_config.get("mlp_bias"))
    if _moe(pool) and cfg.get("target_parameters"):
        raise AdapterError("unsupported", f"{d.path}: target_parameters "
                           f"{brief_repr(cfg['target_parameters'])} puts LoRA on the weights of "
                           f"{_moe(pool)}'s experts, which no replica serves (LoRA on a mixture of "
                           f"experts is not supported); retrain with target_modules on attention: "
                           f"{', '.join(ATTN_MODULES)}")
    try:
        refuse_unsupported(cfg, base_has_bias=base_has_bias)
    except ConfigRefused as exc:
        raise AdapterError(exc.code, f"{d.path}: {exc}") from None
    if d.has("added_tokens.json"):
        raise AdapterError("unsupported", f"{d.path}: added_tokens.json is not supported: the "
                           "adapter was trained with tokens added to the vocabulary, and the base "
                           "model's vocabulary is fixed; retrain without adding tokens")


def _moe(pool: PoolConfigured) -> str:
    """The pool's model family where it is a mixture of experts, else ""."""
    family = pool.model_config.get("model_type")
    return family if family in MOE_FAMILIES else ""


def _targeted(path: Path, cfg: dict[str, Any], pool: PoolConfigured) -> frozenset[tuple[int, str]]:
    """The (layer, module) pairs PEFT puts LoRA on, each of a module the pool holds."""
    try:
        pairs = resolve_targets(cfg, num_layers=pool.num_layers)
    except ConfigRefused as exc:
        raise AdapterError(exc.code, f"{path}: {exc}") from None
    outside = [m for m in MODULES if m not in pool.targets and any(p[1] == m for p in pairs)]
    if outside and _moe(pool):
        raise _invalid(path, f"target_modules selects {', '.join(outside)}, which {_moe(pool)} has "
                       "only as experts, and LoRA on a mixture of experts is not served; retrain "
                       f"with target_modules on attention: {', '.join(ATTN_MODULES)}")
    if outside:
        raise _invalid(path, f"target_modules selects {', '.join(outside)}, which the pool does "
                       f"not hold (pool targets: {', '.join(pool.targets)}); configure a new pool "
                       "(a new --data-dir) with --targets including them, or retrain the adapter "
                       "on the pool's targets")
    return pairs


def _rank_alpha(path: Path, cfg: dict[str, Any], pool: PoolConfigured) -> tuple[int, float]:
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if type(r) is not int or r < 1:
        raise _invalid(path, f"r must be a positive integer, got {brief_repr(r)}")
    if (problem := alpha_problem(alpha, "lora_alpha")) is not None:
        raise _invalid(path, problem)
    if r > pool.max_rank:
        raise AdapterError("invalid_adapter", f"{path}: rank {brief_repr(r)} is above the pool's "
                           f"--max-rank {pool.max_rank}; configure a new pool with a larger "
                           "--max-rank, or retrain the adapter with a smaller r")
    return r, float(cast(float, alpha))  # a finite positive number: alpha_problem said so


def _weights_header(d: _Opened, max_bytes: int) -> tuple[BinaryIO, Header, int]:
    """The weights' handle, header and size. The header is checked against the file's size
    (the tensors must tile the file exactly) before any tensor is read: a file that lies
    about its size or layout, sparse or not, is refused without reading it."""
    path, f = d.path, d.file(WEIGHTS_FILE)
    if f is None:
        if d.has("adapter_model.bin"):
            raise AdapterError("unsupported", f"{path}: adapter_model.bin is a pickle file and "
                               "pickle files are refused; save the adapter with "
                               "save_pretrained(..., safe_serialization=True) to get "
                               f"{WEIGHTS_FILE}")
        raise _invalid(path, f"no {WEIGHTS_FILE}")
    try:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise _invalid(path, f"cannot read {WEIGHTS_FILE}: it is above the "
                           f"{max_bytes}-byte limit (statesvc --max-adapter-bytes)")
        return f, read_header_of(f), size
    except TensorFileError as exc:
        raise _invalid(path, f"{WEIGHTS_FILE}: {exc}") from None
    except OSError as exc:
        raise _invalid(path, f"cannot read {WEIGHTS_FILE}: {exc.strerror or exc}") from None


def _read_weights(path: Path, f: BinaryIO, size: int,
                  progress: Callable[[], None]) -> tuple[bytearray, str]:
    """The file's `size` bytes (what its checked header covers) and their sha256, read and
    hashed a chunk at a time with `progress()` after each. A file that changed size since its
    header was checked is refused."""
    data, digest = bytearray(size), hashlib.sha256()
    view, done = memoryview(data), 0
    try:
        while done < size:
            n = os.preadv(f.fileno(), [view[done:done + READ_CHUNK]], done)
            if n == 0:
                break
            digest.update(view[done:done + n])
            done += n
            progress()
        longer = os.pread(f.fileno(), 1, size) != b""
    except OSError as exc:
        raise _invalid(path, f"cannot read {WEIGHTS_FILE}: {exc.strerror or exc}") from None
    finally:
        view.release()
    if done != size or longer:
        raise _invalid(path, f"{WEIGHTS_FILE} changed size while it was read; load it again "
                       "once it is written")
    return data, digest.hexdigest()


def _check_header(path: Path, header: Header, pool: PoolConfigured,
                  rank: int) -> frozenset[tuple[int, str]]:
    """The tensors' names, dtypes and shapes against the pool, from the header alone; returns
    the (layer, module) pairs they hold."""
    if not header.tensors:
        raise _invalid(path, f"{WEIGHTS_FILE} holds no tensors")
    keys: dict[LoraKey, str] = {}
    for name, info in sorted(header.tensors.items()):
        key = parse_lora_name(name)
        if key is None and ".experts." in name:
            raise AdapterError("unsupported", f"{path}: tensor {name!r} is LoRA on a mixture of "
                               "experts, which no replica serves; retrain with target_modules on "
                               f"attention: {', '.join(ATTN_MODULES)}")
        if key is None:
            if "embed_tokens" in name or "lm_head" in name:
                raise AdapterError("unsupported", f"{path}: tensor {name!r} holds weights of the "
                                   "token embeddings or the lm_head, and the pool holds LoRA for "
                                   f"the layers' projections ({', '.join(MODULES)}) only; retrain "
                                   "without LoRA on embed_tokens or lm_head, modules_to_save and "
                                   "trainable_token_indices, and save with "
                                   "save_pretrained(..., save_embedding_layers=False)")
            raise _invalid(path, f"tensor {name!r} is not a LoRA weight of a Llama layer; "
                           "expected names like base_model.model.model.layers.0.self_attn."
                           "q_proj.lora_A.weight")
        if key.layer >= pool.num_layers:
            raise _invalid(path, f"tensor {name!r} is for layer {key.layer}, but the base model "
                           f"has {pool.num_layers} layers")
        if key.module not in pool.targets:
            raise _invalid(path, f"tensor {name!r} targets {key.module}, which the pool does not "
                           f"hold (pool targets: {', '.join(pool.targets)}); configure a new pool "
                           "(a new --data-dir) with --targets including it")
        if info.dtype not in FLOAT_DTYPES:
            raise _invalid(path, f"tensor {name!r} has dtype {info.dtype}; use F32, F16 or BF16")
        in_f, out_f = pool.module_dims[key.module]
        want = (rank, in_f) if key.matrix == "A" else (out_f, rank)
        if info.shape != want:
            raise _invalid(path, f"tensor {name!r} has shape {list(info.shape)}, expected "
                           f"{list(want)} (r={rank}, {key.module} is {in_f} -> {out_f})")
        keys[key] = name
    for key, name in keys.items():
        other = LoraKey(key.layer, key.module, "B" if key.matrix == "A" else "A")
        if other not in keys:
            raise _invalid(path, f"tensor {name!r} has no matching lora_{other.matrix}")
    return frozenset((k.layer, k.module) for k in keys)


def inspect_adapter(path: Path, pool: PoolConfigured, *, max_bytes: int = MAX_ADAPTER_BYTES,
                    roots: tuple[Path, ...] = ANYWHERE,
                    stored: Callable[[str], bool] | None = None,
                    progress: Callable[[], None] = lambda: None) -> Candidate:
    """Validate a PEFT LoRA directory for `pool`; raises AdapterError saying what to fix.

    The directory and its files are opened beneath `roots` (symlinks that lead out of them
    are `forbidden`) and read from those handles only. `progress` is called while large
    weights are read and checked. With `stored` (is a blob with this sha256 already kept?),
    a directory inspected before and unchanged since, whose weights are stored, is answered
    without reading it again (the rule is at `_SEEN`)."""
    path = Path(path).absolute()
    with _Opened(path, roots) as d:
        if stored is None:
            return _inspect(d, pool, max_bytes, progress)
        key = (str(path), roots, pool.fingerprint, pool.targets, pool.num_layers, pool.max_rank,
               pool.dtype, max_bytes)
        started = time.time_ns()
        stats = d.stats()
        seen = _SEEN.get(key)
        if seen is not None and stats is not None and seen[0] == stats and stored(seen[1].sha256):
            _SEEN.move_to_end(key)
            return seen[1]
        cand = _inspect(d, pool, max_bytes, progress)
    if stats is not None and _settled(stats, started):
        _SEEN[key] = (stats, replace(cand, weights=None))
        _SEEN.move_to_end(key)
        if len(_SEEN) > _SEEN_MAX:
            _SEEN.popitem(last=False)
    return cand


def _inspect(d: _Opened, pool: PoolConfigured, max_bytes: int,
             progress: Callable[[], None]) -> Candidate:
    path = d.path
    cfg = _read_config(d)
    _refuse_unsupported(d, cfg, pool)
    rank, alpha = _rank_alpha(path, cfg, pool)
    targeted = _targeted(path, cfg, pool)
    f, header, size = _weights_header(d, max_bytes)
    present = _check_header(path, header, pool, rank)
    ignored = sorted(present - targeted)
    if ignored:
        layer, module = ignored[0]
        raise _invalid(path, f"{WEIGHTS_FILE} holds LoRA weights for layer {layer} {module}, which "
                       f"target_modules {brief_repr(cfg.get('target_modules'))} does not select, "
                       "so PEFT would load the adapter without them; fix target_modules (or "
                       "exclude_modules, layers_to_transform) in adapter_config.json")
    missing = sorted(targeted - present)
    if missing and not unloaded_is_zero(cfg):
        layer, module = missing[0]
        raise _invalid(path, f"target_modules selects layer {layer} {module}, but {WEIGHTS_FILE} "
                       "holds no weights for it, and with init_lora_weights="
                       f"{brief_repr(cfg.get('init_lora_weights'))} PEFT would give it random "
                       "ones; add its weights, or leave it out of target_modules")
    targets = tuple(m for m in MODULES if any(p[1] == m for p in present))
    use_rslora = cfg.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise _invalid(path, f"use_rslora must be true or false, got {use_rslora!r}")
    _check_scaling(path, pool, alpha, rank, use_rslora)
    data, sha256 = _read_weights(path, f, size, progress)
    if sha256 not in _FINITE:  # the same bytes are finite or not whatever the pool
        for name, info in sorted(header.tensors.items()):
            if not is_finite(data, header, info):
                raise _invalid(path, f"tensor {name!r} contains NaN or Inf values")
            progress()
        _FINITE[sha256] = None
        if len(_FINITE) > _FINITE_MAX:
            _FINITE.popitem(last=False)
    _FINITE.move_to_end(sha256)
    return Candidate(data, sha256, len(data), rank, alpha, use_rslora, targets)


def _check_scaling(path: Path, pool: PoolConfigured, alpha: float, rank: int,
                   use_rslora: bool) -> None:
    """The pool multiplies by the scaling in its dtype: it must be finite there."""
    scaling, largest = lora_scaling(alpha, rank, use_rslora), POOL_DTYPE_MAX[pool.dtype]
    if not scaling <= largest:
        divisor = math.sqrt(rank) if use_rslora else rank
        raise _invalid(path, f"lora_alpha {alpha:g} gives a scaling of {scaling:g} (lora_alpha "
                       f"/ {'sqrt(r)' if use_rslora else 'r'}, r={rank}), beyond the largest "
                       f"{pool.dtype} ({largest:.6g}) the pool computes with; use a lora_alpha "
                       f"of at most {largest * divisor:.6g} (PEFT's default is 8)")


# Directories inspected before, by path, roots and pool: the stat of the directory and of its
# two files (from the handles that inspection read) and its verdict (without the bytes).
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


def _settled(stats: _Stats, started_ns: int) -> bool:
    return all(st[4] < started_ns - RACY_NS and st[3] < started_ns - RACY_NS for st in stats)


# The sha256 of weights already found free of NaN and Inf: a reload of a known adapter costs
# one read and one hash, not a scan of every tensor.
_FINITE: OrderedDict[str, None] = OrderedDict()
_FINITE_MAX = 4096


def same_adapter(old: AdapterLoaded, cand: Candidate, pin: bool) -> bool:
    """Loading `cand` (pinned or not) would record nothing new over `old`."""
    return ((old.sha256, old.rank, old.alpha, old.use_rslora, old.targets, old.pinned)
            == (cand.sha256, cand.rank, cand.alpha, cand.use_rslora, cand.targets, pin))


def absolute_path(path: str, field: str) -> Path:
    """`path` as given by a client, which must be absolute (bad_request otherwise)."""
    if "\0" in path:  # no file name holds one: the OS refuses it
        raise AdapterError("bad_request", f"{field} contains a NUL byte, which no path on the "
                           f"state service's host can hold: {path!r}", field)
    p = Path(path)
    if not p.is_absolute():
        raise AdapterError("bad_request", f"{field} must be an absolute path on the state "
                           f"service's host, got {path!r} (loractl sends absolute paths)", field)
    return p
