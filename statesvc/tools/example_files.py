"""How the example writer writes its files: each tensor drawn from its own seeded generator,
safetensors laid out as the reference writer lays them out (bfloat16 too, which numpy lacks),
and JSON as transformers and PEFT write it. Only numpy, json and ``safetensors.numpy``.

Every tensor is drawn from its own ``numpy.random.Generator`` seeded by
``(seed, sha256(name))``, so the same seed gives byte-identical files.
"""
from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from safetensors.numpy import save_file

__all__ = ["DTYPES", "Dtype", "encode_safetensors", "normal", "save_tensors", "to_bf16_bits",
           "write_json", "write_safetensors"]

Dtype = Literal["float32", "bfloat16"]
DTYPES: tuple[Dtype, ...] = ("float32", "bfloat16")  # what the example's files may hold


def _rng(seed: int, *names: str) -> np.random.Generator:
    """A generator keyed by the seed and a stable hash of the names."""
    digest = hashlib.sha256("\x00".join(names).encode()).digest()
    return np.random.default_rng([seed, int.from_bytes(digest[:8], "little")])


def normal(seed: int, names: tuple[str, ...], shape: tuple[int, ...], std: float) -> npt.NDArray[np.float32]:
    """N(0, std²) of `shape`, drawn from the generator of (`seed`, `names`)."""
    out: npt.NDArray[np.float32] = _rng(seed, *names).standard_normal(shape, dtype=np.float32)
    out *= np.float32(std)
    return out


def to_bf16_bits(x: npt.NDArray[np.float32]) -> npt.NDArray[np.uint16]:
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


def save_tensors(path: Path, tensors: dict[str, npt.NDArray[np.float32]], dtype: str) -> None:
    """Write float32 arrays to a safetensors file as `dtype` (float32, or rounded to bfloat16)."""
    if dtype == "float32":
        write_safetensors(path, tensors, dtype="float32")
    elif dtype == "bfloat16":
        write_safetensors(path, {k: to_bf16_bits(v) for k, v in tensors.items()}, dtype="bfloat16")
    else:
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")


def write_json(path: Path, obj: dict[str, Any], *, newline: bool = True) -> None:
    """Write `obj` as transformers and PEFT write their JSON files."""
    # transformers and PEFT both write sorted keys and indent 2; only transformers
    # ends the file with a newline.
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + ("\n" if newline else ""))
