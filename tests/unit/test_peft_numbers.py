"""Numbers in adapter_config.json that `load` refuses: the reason it gives is the real one, and
a number of hundreds of digits is shown abbreviated."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from statesvc.service import StateService
from statesvc.tools.example import ExampleAssets
from testkit.inproc import CommandError, call

QV = "attn-qv-r8"  # r=8, lora_alpha 16, q_proj and v_proj
HUGE = 10**400  # beyond any float: json reads it as an int


def refusal(svc: StateService, example: ExampleAssets, tmp_path: Path, **cfg: Any) -> str:
    path = tmp_path / "adapter"
    shutil.copytree(example.adapter_dirs[QV], path)
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, **cfg}))
    head = svc.store.head()
    with pytest.raises(CommandError) as info:
        call(svc, "load", name="x", path=str(path))
    assert svc.store.head() == head
    assert info.value.code == "invalid_adapter", str(info.value)
    return str(info.value)


@pytest.mark.parametrize("alpha", [HUGE, 1e308])
def test_lora_alpha_beyond_float32(svc: StateService, example: ExampleAssets, tmp_path: Path,
                                   alpha: Any) -> None:
    """A huge integer is refused for its size, as a huge float is, never as not positive."""
    why = refusal(svc, example, tmp_path, lora_alpha=alpha)
    assert "positive" not in why and "float32" in why
    assert len(why) < 400 and "000" * 30 not in why


def test_huge_lora_alpha_is_abbreviated(svc: StateService, example: ExampleAssets,
                                        tmp_path: Path) -> None:
    why = refusal(svc, example, tmp_path, lora_alpha=HUGE)
    assert "lora_alpha 10000000...0000 (401 digits) is beyond float32's range" in why


def test_negative_huge_lora_alpha(svc: StateService, example: ExampleAssets,
                                  tmp_path: Path) -> None:
    why = refusal(svc, example, tmp_path, lora_alpha=-HUGE)
    assert "lora_alpha must be a positive number, got -10000000...0000 (401 digits)" in why


@pytest.mark.parametrize("rank, shown", [("x", "'x'"), (0, "0"), (2.5, "2.5"), (True, "True")])
def test_rank_pattern_value_not_a_rank(svc: StateService, example: ExampleAssets,
                                       tmp_path: Path, rank: Any, shown: str) -> None:
    why = refusal(svc, example, tmp_path, rank_pattern={"q_proj": rank})
    assert f"rank_pattern['q_proj']: a rank must be a positive integer, got {shown}" in why


@pytest.mark.parametrize("alpha, words", [
    ("x", "alpha_pattern['q_proj']: a lora_alpha must be a positive number, got 'x'"),
    (-1, "alpha_pattern['q_proj']: a lora_alpha must be a positive number, got -1"),
    (HUGE, "alpha_pattern['q_proj']: a lora_alpha 10000000...0000 (401 digits) is beyond "
           "float32's range"),
])
def test_alpha_pattern_value_not_an_alpha(svc: StateService, example: ExampleAssets,
                                          tmp_path: Path, alpha: Any, words: str) -> None:
    assert words in refusal(svc, example, tmp_path, alpha_pattern={"q_proj": alpha})
