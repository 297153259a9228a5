"""Adapter weights on the replica: blobs fetched by sha256, verified, cached, parsed."""
from __future__ import annotations

import functools
import hashlib
import os
import threading
from pathlib import Path

import numpy as np

from computed.pool import SlotWeights
from shared.client import ControlClient
from shared.config import MAX_BLOB_CHUNK
from shared.events import AdapterLoaded
from shared.peft import LoraKey, parse_lora_name
from shared.tensorfile import Header, TensorFileError, TensorInfo, parse_header, to_float32


class BlobError(Exception):
    """A blob that could not be fetched, verified or parsed; the pool is left as it was."""


class BlobCache:
    """Blobs under `root`, by sha256; a cached file whose hash no longer matches is fetched again."""

    def __init__(self, root: Path, client: ControlClient) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        for leftover in self.root.glob("*.tmp*"):  # a crash while caching a blob
            leftover.unlink(missing_ok=True)
        self.client = client
        self.fetches = 0  # blobs fetched from statesvc (not served from the cache)
        self._lock = threading.Lock()  # the sync thread and the engine's fills both read blobs

    def path(self, sha256: str) -> Path:
        return self.root / sha256

    def get(self, sha256: str) -> bytes:
        with self._lock:
            return self._get(sha256)

    def _get(self, sha256: str) -> bytes:
        cached = self.path(sha256)
        if cached.is_file():
            data = cached.read_bytes()
            if hashlib.sha256(data).hexdigest() == sha256:
                return data
            cached.unlink()  # damaged or tampered with: fetch it again
        data = self._fetch(sha256)
        tmp = cached.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, cached)
        return data

    def _fetch(self, sha256: str) -> bytes:
        self.fetches += 1
        parts: list[bytes] = []
        offset, size = 0, None
        while size is None or offset < size:
            chunk = self.client.call("blob", {"sha256": sha256, "offset": offset,
                                              "length": MAX_BLOB_CHUNK})
            size = int(chunk["size"])
            data = chunk["data"]
            if not data and offset < size:
                raise BlobError(f"blob {sha256[:12]} ended at {offset} of {size} bytes")
            parts.append(data)
            offset += len(data)
        blob = b"".join(parts)
        got = hashlib.sha256(blob).hexdigest()
        if got != sha256:
            raise BlobError(f"blob {sha256[:12]} from statesvc hashes to {got[:12]}; not applied, "
                            "will fetch it again")
        return blob


# a header up to this size is parsed once per distinct header (its bytes are the cache key)
CACHED_HEADER_BYTES = 1 << 20
_Layout = tuple[Header, tuple[tuple[LoraKey | None, TensorInfo], ...]]


def _parse_layout(head: bytes, size: int) -> _Layout:
    """The header `head` (the length and the JSON) of a `size`-byte safetensors file, parsed
    and checked, each tensor with its LoRA key (None: not a LoRA weight)."""
    header = parse_header(head, size)
    return header, tuple((parse_lora_name(name), info) for name, info in header.tensors.items())


# adapters of one shape have identical headers (names, shapes, offsets): each distinct one is
# parsed and checked once, not at every load (the result depends on nothing else)
_cached_layout = functools.lru_cache(maxsize=16)(_parse_layout)


def _layout(data: bytes) -> _Layout:
    n = int.from_bytes(data[:8], "little")
    if len(data) < 8 or 8 + n > len(data) or n > CACHED_HEADER_BYTES:
        return _parse_layout(data, len(data))  # refused, or too big to keep
    return _cached_layout(bytes(data[:8 + n]), len(data))


def slot_weights(data: bytes, adapter: AdapterLoaded) -> SlotWeights:
    """Parse an adapter's safetensors bytes into the pool's (layer, module) -> (A, B) pairs."""
    what = f"adapter {adapter.name} v{adapter.version}"
    try:
        header, keys = _layout(data)
    except TensorFileError as exc:
        raise BlobError(f"{what}: {exc}") from None
    halves: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, info in keys:
        if key is None:
            raise BlobError(f"{what}: unexpected tensor {info.name!r}")
        try:
            # F32 tensors stay views of the (immutable) blob: the slot write copies them once
            halves.setdefault((key.layer, key.module), {})[key.matrix] = to_float32(
                data, header, info, copy=False)
        except TensorFileError as exc:
            raise BlobError(f"{what}: {exc}") from None
    pairs = {}
    for where, ab in halves.items():
        if set(ab) != {"A", "B"}:
            raise BlobError(f"{what}: layer {where[0]} {where[1]} lacks lora_A or lora_B")
        pairs[where] = (ab["A"], ab["B"])
    return SlotWeights(scaling=adapter.scaling, rank=adapter.rank, pairs=pairs)
