"""The replica's parse of adapter blobs (computed/residency/blob_cache.py `slot_weights`): each distinct
header is parsed and checked once, and what that changes must not show."""
from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import save

from computed.residency.blob_cache import BlobError, slot_weights
from shared.events import AdapterLoaded

NAME = "base_model.model.model.layers.{}.self_attn.q_proj.lora_{}.weight"


def blob(seed: int, *, rank: int = 4, names: str = NAME) -> bytes:
    rng = np.random.default_rng(seed)
    return save({names.format(layer, m): rng.standard_normal(
        (rank, 32) if m == "A" else (32, rank)).astype(np.float32)
        for layer in range(2) for m in "AB"})


def event(name: str, rank: int = 4) -> AdapterLoaded:
    return AdapterLoaded(name=name, version=1, sha256="0" * 64, size=0, rank=rank, alpha=8.0,
                         scaling=2.0, use_rslora=False, targets=("q_proj",), pinned=False)


def test_adapters_with_the_same_header_parse_to_their_own_weights() -> None:
    first, second = blob(1), blob(2)
    assert first[:200] == second[:200]  # the same header bytes: one parse serves both
    for data, seed in [(first, 1), (second, 2), (first, 1)]:
        rng = np.random.default_rng(seed)
        got = slot_weights(data, event(f"s{seed}"))
        for layer in range(2):
            a, b = rng.standard_normal((4, 32)), rng.standard_normal((32, 4))
            np.testing.assert_array_equal(got.pairs[(layer, "q_proj")][0], a.astype(np.float32))
            np.testing.assert_array_equal(got.pairs[(layer, "q_proj")][1], b.astype(np.float32))


def test_a_known_header_on_a_blob_of_another_size_is_refused() -> None:
    """The size is part of what was checked: the same header with a byte more or less is
    refused, every time, naming the adapter."""
    good = blob(3)
    slot_weights(good, event("ok"))
    for bad in (good + b"\0", good[:-1]):
        for _ in range(2):
            with pytest.raises(BlobError, match=r"adapter bad v1: .*(follow the last|outside)"):
                slot_weights(bad, event("bad"))


def test_a_header_that_is_not_a_lora_is_refused_each_time() -> None:
    data = blob(4, names="model.layers.{}.q_proj.{}.weight")
    for _ in range(2):
        with pytest.raises(BlobError, match="adapter odd v1: unexpected tensor 'model.layers"):
            slot_weights(data, event("odd"))
