"""A strict reader for safetensors files.

Every header is checked before any tensor is touched: the header length, the
JSON, each tensor's dtype, shape and offsets (byte count equal to the shape's,
and together tiling the data section exactly, as the reference reader requires:
no gaps, no overlap, no trailing bytes), so a file that lies is refused before
anything is allocated or read for it.
"""
from __future__ import annotations

import json
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from shared.files import FileError, open_regular

# dtype name -> bytes per element
DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}
FLOAT_DTYPES = ("F32", "F16", "BF16")
MAX_HEADER_BYTES = 100 << 20
MAX_DIMS = 8  # LoRA and model weights have 1 or 2


class TensorFileError(ValueError):
    """The bytes are not a well-formed safetensors file."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # offset from the start of the data section
    end: int


@dataclass(frozen=True)
class Header:
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    data_start: int  # absolute offset of the data section in the file


def _check_entry(name: str, entry: Any, data_len: int) -> TensorInfo:
    # other keys are ignored, as the safetensors library ignores them
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
        raise TensorFileError(f"tensor {name!r}: entry must have dtype, shape and data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise TensorFileError(f"tensor {name!r}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS:  # math.prod of many is quadratic
        raise TensorFileError(f"tensor {name!r}: shape must be a list of at most {MAX_DIMS} "
                              "dimensions")
    if not all(type(d) is int and 0 <= d < 1 << 40 for d in shape):
        raise TensorFileError(f"tensor {name!r}: shape must be a list of non-negative integers, got {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(type(o) is int for o in offsets)):
        raise TensorFileError(f"tensor {name!r}: data_offsets must be [begin, end], got {offsets!r}")
    start, end = offsets
    if not 0 <= start <= end <= data_len:
        raise TensorFileError(
            f"tensor {name!r}: data_offsets {offsets} fall outside the file's data section")
    expected = math.prod(shape) * DTYPE_SIZES[dtype]
    if end - start != expected:
        raise TensorFileError(
            f"tensor {name!r}: {end - start} bytes for shape {shape} of {dtype}, expected {expected}")
    return TensorInfo(name, dtype, tuple(shape), start, end)


def parse_header(prefix: bytes | mmap.mmap, total_size: int, *, max_header: int = MAX_HEADER_BYTES) -> Header:
    """Parse and check a header from the first bytes of a file of `total_size` bytes.

    `prefix` must hold at least the 8-byte length and the header itself.
    """
    if total_size < 8 or len(prefix) < 8:
        raise TensorFileError("the file is too short for a safetensors header")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > max_header:
        raise TensorFileError(f"its first 8 bytes, the header's length, are above the "
                              f"{max_header}-byte limit: not a safetensors file")
    if 8 + n > total_size:
        raise TensorFileError("its first 8 bytes, the header's length, run past the end of "
                              "the file: not a safetensors file, or a truncated one")
    if len(prefix) < 8 + n:
        raise TensorFileError("truncated header")
    try:
        raw = json.loads(bytes(prefix[8:8 + n]).decode("utf-8"))
    except UnicodeDecodeError as exc:  # its message quotes the byte: never echo what was read
        raise TensorFileError(f"header is not UTF-8 text (at byte {exc.start} of it)") from None
    except (ValueError, RecursionError) as exc:  # bad JSON, too deep, too many digits
        raise TensorFileError(f"header is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise TensorFileError("header must be a JSON object")
    metadata = raw.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise TensorFileError("__metadata__ must map strings to strings")
    data_len = total_size - 8 - n
    tensors = {name: _check_entry(name, entry, data_len) for name, entry in raw.items()}
    end = 0  # in offset order (ties: empty tensors first), each tensor starts where the last ended
    for start, stop, name in sorted((t.start, t.end, t.name) for t in tensors.values()):
        if start < end:
            raise TensorFileError(f"tensor {name!r} (data offsets {start}..{stop}) overlaps the "
                                  f"tensor before it, which ends at {end}")
        if start > end:
            raise TensorFileError(f"a gap of {start - end} bytes before tensor {name!r} (data "
                                  f"offset {start}, the tensor before it ends at {end}); "
                                  "safetensors files have no gaps between tensors")
        end = stop
    if end != data_len:
        raise TensorFileError(f"{data_len - end} bytes follow the last tensor; the safetensors "
                              "format has no trailing bytes")
    return Header(tensors, metadata, 8 + n)


def parse_bytes(buf: bytes) -> Header:
    return parse_header(buf, len(buf))


def read_header(path: Path) -> Header:
    """Parse the header of a file on disk without reading its tensors."""
    try:
        f = open_regular(path)
    except FileError as exc:
        raise TensorFileError(str(exc)) from None
    with f:
        return read_header_of(f)


def read_header_of(f: BinaryIO) -> Header:
    """Parse the header of open file `f` (read from its start) without reading its tensors:
    the file's size is checked against the header before anything else is read."""
    size = os.fstat(f.fileno()).st_size
    head = os.pread(f.fileno(), 8, 0)
    if len(head) == 8:
        (n,) = struct.unpack("<Q", head)
        if n <= MAX_HEADER_BYTES and 8 + n <= size:  # read only what the file can hold
            head += os.pread(f.fileno(), n, 8)
    return parse_header(head, size)


def raw_bytes(buf: bytes | bytearray | memoryview, header: Header, info: TensorInfo) -> memoryview:
    """The tensor's bytes as stored (little-endian, its safetensors dtype), a view of `buf`."""
    return memoryview(buf)[header.data_start + info.start:header.data_start + info.end]


_raw = raw_bytes


def is_finite(buf: bytes | bytearray | memoryview, header: Header, info: TensorInfo) -> bool:
    """True when a float tensor holds no NaN or Inf (checked on the raw bits)."""
    raw = _raw(buf, header, info)
    if info.dtype == "F32":
        return bool(np.isfinite(np.frombuffer(raw, "<f4")).all())
    if info.dtype == "F16":
        return not bool(((np.frombuffer(raw, "<u2") & 0x7C00) == 0x7C00).any())
    if info.dtype == "BF16":
        return not bool(((np.frombuffer(raw, "<u2") & 0x7F80) == 0x7F80).any())
    raise TensorFileError(f"tensor {info.name!r}: {info.dtype} is not a float dtype")


def to_float32(buf: bytes | bytearray | memoryview, header: Header, info: TensorInfo, *,
               copy: bool = True) -> np.ndarray:
    """A float tensor as a float32 array (BF16 and F16 widened exactly). `copy=False`: an F32
    tensor comes back as a read-only view of `buf`, which then lives as long as the array."""
    raw = _raw(buf, header, info)
    if info.dtype == "F32":
        arr = np.frombuffer(raw, "<f4").astype(np.float32, copy=copy)
    elif info.dtype == "F16":
        arr = np.frombuffer(raw, "<f2").astype(np.float32)
    elif info.dtype == "BF16":
        arr = (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)
    else:
        raise TensorFileError(f"tensor {info.name!r}: {info.dtype} is not a float dtype")
    return arr.reshape(info.shape)
