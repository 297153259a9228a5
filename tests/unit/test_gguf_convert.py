"""The GGUF converter's pure parts (benchmarks/gguf_convert.py): the Q/K row permutation that turns
transformers' rotate-half rope into llama.cpp's interleaved pairs, and the numpy-only safetensors reader.
Writing GGUF needs the `gguf` package, which lives in the llama.cpp peer's venv; the benchmark checks the
written files end to end (llama.cpp's greedy tokens against ours)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import save_file as save_torch

from benchmarks.gguf_convert import ConvertError, _float32, _permute, read_safetensors


def _angles(d: int, pos: int) -> np.ndarray:
    return pos * 10000.0 ** (-np.arange(0, d, 2) / d)  # [d/2]


def rope_rotate_half(x: np.ndarray, pos: int) -> np.ndarray:
    """transformers' Llama rope on one head: pairs (i, i + d/2)."""
    d = x.shape[-1]
    a = np.concatenate([_angles(d, pos)] * 2)
    rot = np.concatenate([-x[d // 2:], x[:d // 2]])
    return x * np.cos(a) + rot * np.sin(a)


def rope_interleaved(x: np.ndarray, pos: int) -> np.ndarray:
    """llama.cpp's rope for llama (LLAMA_ROPE_TYPE_NORM) on one head: pairs (2i, 2i + 1)."""
    a = _angles(x.shape[-1], pos)
    even, odd = x[0::2], x[1::2]
    out = np.empty_like(x)
    out[0::2] = even * np.cos(a) - odd * np.sin(a)
    out[1::2] = even * np.sin(a) + odd * np.cos(a)
    return out


@pytest.mark.parametrize("heads", [1, 2, 4])
def test_permuted_rows_under_interleaved_rope_equal_rotate_half_rope(heads: int) -> None:
    d, hidden = 8, 6
    rng = np.random.default_rng(heads)
    w, h = rng.normal(size=(heads * d, hidden)), rng.normal(size=hidden)
    w_gguf = _permute(w, heads)
    for pos in (0, 3, 17):
        ours = np.concatenate([rope_rotate_half(q, pos) for q in (w @ h).reshape(heads, d)])
        theirs = np.concatenate([rope_interleaved(q, pos) for q in (w_gguf @ h).reshape(heads, d)])
        # the same rotated query, its rows in llama.cpp's order
        np.testing.assert_allclose(theirs, _permute(ours[:, None], heads)[:, 0], atol=1e-12)
    # dot products of rotated q and k (what attention sees) are unchanged by the permutation
    q, k = rng.normal(size=heads * d), rng.normal(size=heads * d)
    assert np.isclose(_permute(q[:, None], heads)[:, 0] @ _permute(k[:, None], heads)[:, 0], q @ k)


def test_permuting_lora_b_equals_permuting_the_merged_delta() -> None:
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(4, 6)), rng.normal(size=(16, 4))
    np.testing.assert_allclose(_permute(b, 2) @ a, _permute(b @ a, 2))


def test_safetensors_reader_matches_the_library(tmp_path: Path) -> None:
    f32 = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
    save_numpy({"x": f32, "y": f32[0].copy()}, str(tmp_path / "f.safetensors"))
    got = read_safetensors(tmp_path / "f.safetensors")
    assert got["x"][0] == "F32" and np.array_equal(got["x"][1], f32) and np.array_equal(got["y"][1], f32[0])
    bf = torch.tensor(f32).to(torch.bfloat16)
    save_torch({"w": bf}, str(tmp_path / "b.safetensors"))
    dtype, bits = read_safetensors(tmp_path / "b.safetensors")["w"]
    assert dtype == "BF16" and bits.dtype == np.uint16
    np.testing.assert_array_equal(_float32(dtype, bits), bf.float().numpy())


def test_safetensors_reader_refuses_other_dtypes(tmp_path: Path) -> None:
    save_numpy({"i": np.arange(3, dtype=np.int64)}, str(tmp_path / "i.safetensors"))
    with pytest.raises(ConvertError, match="only F32, BF16 and F16"):
        read_safetensors(tmp_path / "i.safetensors")
