"""Prefix keys: what names a prompt prefix's KV, for the replica's prefix cache and the gateway.

A prefix's KV depends on the base model, the adapter's weights and scaling, and the tokens. A
replica serves one base model, so a cache entry is keyed by the adapter's *content* (`root`:
the sha256 of its safetensors and its scaling, never its name or version) and a chain of
block hashes over the tokens, `BLOCK_TOKENS` to a block: block j's hash covers the root and
every token of blocks 0..j. A same-name replace with other weights or another alpha has
another root, so its requests never meet the old KV; an unload and a reload of the same
content meets the KV it left, which is the same KV.

The replica reports, for routers, the hashes of the chains it holds at depths of 1, 2, 4, 8,
... blocks (`summary_depths`); the gateway hashes a request's prompt at the same depths and
prefers the replica holding the deepest one (docs/gateway.md "Routing").
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

BLOCK_TOKENS = 16  # tokens per prefix block; equals the KV cache's K block (computed/model/kv_cache.py)
BASE_ROOT = "base"  # the root of the base model's prefixes (no adapter)
SUMMARY_LIMIT = 4096  # chain hashes a replica reports to routers at most


def content_root(sha256: str | None, scaling: float = 0.0) -> str:
    """The prefix root of an adapter version: the sha256 of its `adapter_model.safetensors` and
    its scaling (alpha / rank, or / sqrt(rank) with rsLoRA); `BASE_ROOT` for the base model
    (sha256 None)."""
    if sha256 is None:
        return BASE_ROOT
    return hashlib.sha256(f"{sha256}:{float(scaling)!r}".encode()).hexdigest()


def block_hashes(root: str, tokens: Sequence[int] | np.ndarray, *, blocks: int | None = None) -> list[str]:
    """The chain hashes (hex, 32 digits) of the whole blocks of `tokens` under `root`, at most
    `blocks` of them: entry j covers tokens [0, 16 (j + 1))."""
    ids = np.asarray(tokens, dtype="<i4")
    n = len(ids) // BLOCK_TOKENS if blocks is None else min(blocks, len(ids) // BLOCK_TOKENS)
    out: list[str] = []
    h = hashlib.blake2b(root.encode(), digest_size=16).digest()
    for j in range(n):
        h = hashlib.blake2b(h + ids[j * BLOCK_TOKENS:(j + 1) * BLOCK_TOKENS].tobytes(), digest_size=16).digest()
        out.append(h.hex())
    return out


def summary_depths(blocks: int) -> list[int]:
    """The depths (in blocks, 1-based) at which a chain of `blocks` blocks is reported to
    routers: 1, 2, 4, 8, ... up to `blocks`."""
    out, d = [], 1
    while d <= blocks:
        out.append(d)
        d *= 2
    return out


def matched_tokens(root: str, tokens: Sequence[int] | np.ndarray, held: frozenset[str] | set[str]) -> int:
    """How many leading tokens of `tokens` under `root` a replica reporting `held` (its summary
    hashes) holds KV for, to the summary's resolution: 16 x the deepest reported depth found."""
    chain = block_hashes(root, tokens)
    best = 0
    for d in summary_depths(len(chain)):
        if chain[d - 1] in held:
            best = d
    return best * BLOCK_TOKENS
