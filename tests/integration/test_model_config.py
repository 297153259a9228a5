"""`pool init` refuses exactly the model configs no replica can serve, in a replica's words.

The genesis event is immutable: a config that passed `pool init` and that every replica
then refused (or that no client could decode again) left a data dir no fleet could use.
"""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from computed.model.config import ModelLoadError
from computed.model.loader import load_model
from shared.fingerprint import ModelError, read_model
from shared.modelconfig import MAX_MODEL_CONFIG_BYTES, MAX_MODEL_CONFIG_DEPTH
from statesvc.tools.example import ExampleAssets
from testkit.fleet import BIN, StateSvc, loractl


def _nested(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = {"x": value}
    return value


def _rope(cfg: dict[str, Any], kind: str) -> None:
    params = {"rope_type": kind, "rope_theta": 10000.0, "factor": 4.0,
              "original_max_position_embeddings": 64}
    cfg["rope_parameters"], cfg["rope_scaling"] = params, dict(params)


BAD_CONFIGS = {
    "unknown rope": lambda cfg: _rope(cfg, "su"),
    "unknown family": lambda cfg: cfg.update(model_type="gpt2"),
    "window beyond positions": lambda cfg: cfg.update(model_type="mistral", sliding_window=4096,
                                                      max_position_embeddings=64),
    "layer pattern length": lambda cfg: cfg.update(model_type="gemma2", hidden_act=None,
                                                   hidden_activation="gelu_pytorch_tanh", sliding_window=8,
                                                   layer_types=["sliding_attention"]),
    "more experts per token than experts": lambda cfg: cfg.update(model_type="mixtral", num_local_experts=4,
                                                                  num_experts_per_tok=6),
    "dense layer beyond the layers": lambda cfg: cfg.update(model_type="qwen3_moe", num_experts=4,
                                                            num_experts_per_tok=2, moe_intermediate_size=32,
                                                            mlp_only_layers=[0, 9]),
    "gelu": lambda cfg: cfg.update(hidden_act="gelu"),
    "deep nesting": lambda cfg: cfg.update(quantization_config=_nested(40)),
    "just too deep": lambda cfg: cfg.update(quantization_config=_nested(MAX_MODEL_CONFIG_DEPTH)),
    "too large": lambda cfg: cfg.update(notes="x" * MAX_MODEL_CONFIG_BYTES),
    "heads not a multiple": lambda cfg: cfg.update(num_key_value_heads=3),
    "hidden_size against the tensors": lambda cfg: cfg.update(hidden_size=32),
    # found by benchmarks/fuzz_long: the expected tensors were listed for every layer the
    # config claims before any was looked up, and statesvc ran out of memory
    "layers beyond the checkpoint": lambda cfg: cfg.update(num_hidden_layers=2**62),
}
EXPECTED = {
    "unknown rope": "config.json: rope type 'su' is not supported",
    "unknown family": "config.json: model_type must be one of llama, qwen2",
    "window beyond positions": "config.json: sliding_window 4096 is larger than max_position_embeddings 64",
    "layer pattern length": "config.json: layer_types has 1 entries; num_hidden_layers is",
    "more experts per token than experts": "config.json: num_experts_per_tok 6 is larger than num_local_experts 4",
    "dense layer beyond the layers": "config.json: mlp_only_layers must be a list of layer indices below "
                                     "num_hidden_layers 2, got [0, 9]",
    "gelu": "config.json: hidden_act 'gelu' is not supported for llama (only 'silu')",
    "deep nesting": f"nests deeper than {MAX_MODEL_CONFIG_DEPTH} levels",
    "just too deep": f"nests deeper than {MAX_MODEL_CONFIG_DEPTH} levels",
    "too large": f"above the {MAX_MODEL_CONFIG_BYTES}-byte limit",
    "heads not a multiple": "num_attention_heads 4 is not a multiple of num_key_value_heads 3",
    "hidden_size against the tensors": "config.json implies",
    "layers beyond the checkpoint": "the checkpoint has no tensor 'model.layers.",
}


def bad_model(example: ExampleAssets, tmp_path: Path, defect: str) -> Path:
    model = tmp_path / defect.replace(" ", "-")
    shutil.copytree(example.model_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    BAD_CONFIGS[defect](cfg)
    (model / "config.json").write_text(json.dumps(cfg))
    return model


def words(text: str) -> str:
    """Text as printed, with the console's line wrapping undone."""
    return " ".join(text.split())


def test_the_limits_admit_a_config_one_level_shallower(example: ExampleAssets,
                                                        tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(example.model_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["quantization_config"] = _nested(MAX_MODEL_CONFIG_DEPTH - 1)
    (model / "config.json").write_text(json.dumps(cfg))
    assert read_model(model).config["quantization_config"] == cfg["quantization_config"]


@pytest.mark.parametrize("defect", sorted(BAD_CONFIGS))
def test_the_model_loader_and_pool_init_refuse_with_one_text(example: ExampleAssets,
                                                             tmp_path: Path, defect: str) -> None:
    model = bad_model(example, tmp_path, defect)
    with pytest.raises(ModelError) as pool_side:
        read_model(model)
    assert EXPECTED[defect] in str(pool_side.value)
    if defect in ("deep nesting", "just too deep", "too large"):
        return  # a replica could build the model; what it cannot do is read the log
    with pytest.raises(ModelLoadError) as replica_side:
        load_model(model)
    assert str(replica_side.value) == str(pool_side.value)


def test_pool_init_refuses_what_no_replica_can_serve(statesvc: StateSvc, example: ExampleAssets,
                                                     tmp_path: Path) -> None:
    """Through real statesvc, loractl and `computed serve`: the same text, nothing appended."""
    for defect in ("unknown rope", "window beyond positions", "layer pattern length", "gelu", "deep nesting",
                   "layers beyond the checkpoint", "more experts per token than experts"):
        model = bad_model(example, tmp_path, defect)
        res = loractl(statesvc, "pool", "init", "--model", str(model), "--max-loras", "2",
                      "--max-rank", "8", "--targets", "all", check=False)
        assert res.returncode == 1, (defect, res.stdout, res.stderr)
        assert "(invalid_model)" in res.stderr, (defect, res.stderr)
        said = words(res.stderr).split("(invalid_model): ", 1)[1]
        assert EXPECTED[defect] in said, (defect, said)
        replica = subprocess.run(
            [str(BIN / "computed"), "serve", "--model", str(model), "--state", statesvc.control,
             "--diffs", statesvc.publish, "--cache-dir", str(tmp_path / "cache")],
            capture_output=True, text=True, timeout=120)
        assert replica.returncode != 0 and "READY" not in replica.stdout, defect
        assert f"Error: {said}" in words(replica.stderr), (defect, replica.stderr)
    events = json.loads(loractl(statesvc, "events", "--json").stdout)
    assert events == []
