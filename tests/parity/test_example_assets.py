"""statesvc.tools.example writes checkpoints and adapters that transformers and PEFT load as their own."""
from __future__ import annotations

import json
import math
import os
import struct
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from shared.projections import ATTN_MODULES, MLP_MODULES, MODULES  # noqa: E402
from shared.modelconfig import MOE_FAMILIES  # noqa: E402
from statesvc.tools.example import (  # noqa: E402
    EXAMPLE_ADAPTERS,
    TRANSFORMERS_VERSION,
    AdapterSpec,
    ModelShape,
    adapter_tensor_names,
    encode_safetensors,
    example_adapters,
    make_example,
    model_tensor_names,
    write_adapter,
    write_model,
)

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _header(path: Path) -> dict[str, Any]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    assert (8 + n) % 8 == 0
    header: dict[str, Any] = json.loads(data[8:8 + n])
    return header


# --------------------------------------------------------------------------- no torch needed

def test_module_imports_no_ml_framework() -> None:
    import subprocess
    code = ("import sys, statesvc.tools.example; "
            "bad = [m for m in ('torch', 'jax', 'transformers', 'peft') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path: Path, dtype: str) -> None:
    a = _tree(make_example(tmp_path / "a", seed=3, dtype=dtype).root)
    b = _tree(make_example(tmp_path / "b", seed=3, dtype=dtype).root)
    c = _tree(make_example(tmp_path / "c", seed=4, dtype=dtype).root)
    assert a == b
    assert a.keys() == c.keys()
    # the model's 3 files, its 3 tokenizer files, each adapter's 2
    assert len(a) == 3 + 3 + 2 * len(EXAMPLE_ADAPTERS)
    for name in a:
        if name.endswith(".safetensors"):
            assert a[name] != c[name], name
        else:
            assert a[name] == c[name], name


def test_adapters_differ_from_each_other(tmp_path: Path) -> None:
    shape = ModelShape()
    spec = AdapterSpec("one", r=4, lora_alpha=8, target_modules=("q_proj",))
    d1 = write_adapter(tmp_path / "1", spec, shape, seed=0, base_model_name_or_path="m")
    d2 = write_adapter(tmp_path / "2", replace(spec, name="two"), shape, seed=0, base_model_name_or_path="m")
    t1, t2 = load_file(d1 / "adapter_model.safetensors"), load_file(d2 / "adapter_model.safetensors")
    assert all(not np.array_equal(t1[k], t2[k]) for k in t1)


def test_example_adapters_cover_the_cases() -> None:
    assert len(EXAMPLE_ADAPTERS) >= 4
    assert len({a.name for a in EXAMPLE_ADAPTERS}) == len(EXAMPLE_ADAPTERS)
    assert len({a.r for a in EXAMPLE_ADAPTERS}) >= 3
    assert len({a.lora_alpha for a in EXAMPLE_ADAPTERS}) >= 3
    assert any(a.use_rslora for a in EXAMPLE_ADAPTERS)
    assert any(set(a.target_modules) == set(MLP_MODULES) for a in EXAMPLE_ADAPTERS)
    assert any(set(a.target_modules) == set(MODULES) for a in EXAMPLE_ADAPTERS)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_a_moe_example_has_lora_on_attention_only(family: str, tmp_path: Path) -> None:
    """A mixture of experts is served LoRA on attention only: its example adapters are those of
    a dense family, rank for rank, on attention; one on the MLP is refused, naming why."""
    adapters = example_adapters(family)
    assert [(a.r, a.lora_alpha, a.use_rslora) for a in adapters] == \
        [(a.r, a.lora_alpha, a.use_rslora) for a in EXAMPLE_ADAPTERS]
    assert all(set(a.target_modules) <= set(ATTN_MODULES) for a in adapters)
    assert sorted(make_example(tmp_path / "ex", family=family).adapter_dirs) == sorted(a.name for a in adapters)
    mlp = next(a for a in EXAMPLE_ADAPTERS if set(a.target_modules) == set(MLP_MODULES))
    with pytest.raises(ValueError, match=f"{mlp.name} targets gate_proj, up_proj, down_proj: {family}'s MLP "
                                         "is a mixture of experts"):
        make_example(tmp_path / "refused", family=family, adapters=(mlp,))
    assert not (tmp_path / "refused").exists()


def test_encoder_matches_reference_writer(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    arrays = {"b.weight": rng.standard_normal((3, 5), dtype=np.float32),
              "a.weight": rng.standard_normal((7,), dtype=np.float32),
              "c": rng.standard_normal((1, 1, 2), dtype=np.float32)}
    save_file(arrays, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    ours = encode_safetensors({k: ("F32", v.shape, v.astype("<f4").tobytes()) for k, v in arrays.items()})
    assert ours == (tmp_path / "ref.safetensors").read_bytes()


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_checkpoint_layout(tmp_path: Path, tie: bool, dtype: str) -> None:
    shape = ModelShape(tie_word_embeddings=tie)
    d = write_model(tmp_path, shape, dtype=dtype)
    assert sorted(p.name for p in d.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    header = _header(d / "model.safetensors")
    assert header.pop("__metadata__") == {"format": "pt"}
    assert sorted(header) == model_tensor_names(shape)
    assert ("lm_head.weight" in header) is not tie
    assert {e["dtype"] for e in header.values()} == {"F32" if dtype == "float32" else "BF16"}
    assert header["model.layers.0.self_attn.k_proj.weight"]["shape"] == [2 * 16, 64]
    assert header["model.layers.1.mlp.down_proj.weight"]["shape"] == [64, 128]
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["torch_dtype"] == cfg["dtype"] == dtype
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"


def test_adapter_layout(tmp_path: Path) -> None:
    shape = ModelShape()
    assets = make_example(tmp_path)
    for spec in EXAMPLE_ADAPTERS:
        d = assets.adapter_dirs[spec.name]
        assert d == tmp_path / "adapters" / spec.name
        cfg = json.loads((d / "adapter_config.json").read_text())
        assert cfg["peft_type"] == "LORA" and cfg["task_type"] == "CAUSAL_LM"
        assert (cfg["r"], cfg["lora_alpha"], cfg["use_rslora"]) == (spec.r, spec.lora_alpha, spec.use_rslora)
        assert sorted(cfg["target_modules"]) == sorted(spec.target_modules)
        header = _header(d / "adapter_model.safetensors")
        assert header.pop("__metadata__") == {"format": "pt"}
        assert sorted(header) == adapter_tensor_names(spec, shape)
        tensors = load_file(d / "adapter_model.safetensors")
        for name, arr in tensors.items():
            module = name.split(".")[-3]
            fan_in, fan_out = shape.module_dims(module)
            assert arr.shape == ((spec.r, fan_in) if ".lora_A." in name else (fan_out, spec.r))
            assert np.abs(arr).max() > 0


# --------------------------------------------------------------------------- transformers / PEFT

@pytest.fixture(scope="module")
def hf() -> Any:
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    torch.manual_seed(0)
    return torch


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return make_example(tmp_path_factory.mktemp("example"), seed=0)


def _ids(torch: Any) -> Any:
    return torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))


def _load(path: Path, **kw: Any) -> tuple[Any, dict[str, Any]]:
    from transformers import LlamaForCausalLM
    model, info = LlamaForCausalLM.from_pretrained(path, output_loading_info=True, **kw)
    return model.eval(), info


@pytest.mark.parametrize("style", ["both", "v5", "v4"])
@pytest.mark.parametrize("tie,rope_scaling", [(False, None), (True, LLAMA3_SCALING)])
def test_transformers_loads_checkpoint(hf: Any, tmp_path: Path, style: str, tie: bool,
                                       rope_scaling: dict[str, Any] | None) -> None:
    from transformers import LlamaConfig
    torch = hf
    shape = ModelShape(tie_word_embeddings=tie, rope_scaling=rope_scaling, rms_norm_eps=1e-6)
    d = write_model(tmp_path, shape, seed=5, config_style=style)  # type: ignore[arg-type]
    model, info = _load(d)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert not info["error_msgs"]

    cfg = LlamaConfig.from_pretrained(d)
    for f in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "tie_word_embeddings", "max_position_embeddings",
              "rms_norm_eps"):
        assert getattr(cfg, f) == getattr(shape, f), f
    assert cfg.dtype == torch.float32
    assert cfg.hidden_act == "silu" and cfg.bos_token_id == 1 and cfg.eos_token_id == 2
    expected_rope = {"rope_type": "default"} if rope_scaling is None else dict(rope_scaling)
    expected_rope["rope_theta"] = shape.rope_theta
    assert cfg.rope_parameters == expected_rope

    # Saved again by transformers, the config is what we wrote (for the v5 layout, byte for byte
    # but for the version stamp: transformers writes its own, we write the one we mirror).
    model.save_pretrained(tmp_path / "resaved")
    if style == "v5":
        import transformers
        installed = f'"transformers_version": "{transformers.__version__}"'
        ours = f'"transformers_version": "{TRANSFORMERS_VERSION}"'
        resaved = (tmp_path / "resaved" / "config.json").read_text()
        assert installed in resaved
        assert resaved.replace(installed, ours) == (d / "config.json").read_text()
    again = LlamaConfig.from_pretrained(tmp_path / "resaved").to_dict()
    first = cfg.to_dict()
    again.pop("_name_or_path", None)
    first.pop("_name_or_path", None)
    assert again == first

    files = load_file(d / "model.safetensors")
    state = model.state_dict()
    for name, arr in files.items():
        assert torch.equal(state[name], torch.from_numpy(arr)), name
    if tie:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        logits = model(_ids(torch)).logits
    assert torch.isfinite(logits).all()
    assert 0.5 < logits.std().item() < 10 and logits.abs().max().item() < 50
    assert logits.softmax(-1).max(-1).values.mean().item() < 0.9  # not degenerate


@pytest.mark.parametrize("tie", [False, True])
def test_transformers_loads_bfloat16(hf: Any, tmp_path: Path, tie: bool) -> None:
    torch = hf
    shape = ModelShape(tie_word_embeddings=tie)
    d32 = write_model(tmp_path / "f32", shape, seed=2, dtype="float32")
    d16 = write_model(tmp_path / "bf16", shape, seed=2, dtype="bfloat16")
    model, info = _load(d16, dtype="auto")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.config.dtype == torch.bfloat16
    ref, _ = _load(d32)
    got, want = model.state_dict(), ref.state_dict()
    assert got.keys() == want.keys()
    for name in got:
        assert got[name].dtype == torch.bfloat16, name
        # our rounding is torch's float32 -> bfloat16 rounding, bit for bit
        assert torch.equal(got[name].view(torch.int16), want[name].to(torch.bfloat16).view(torch.int16)), name
    with torch.no_grad():
        assert torch.isfinite(model(_ids(torch)).logits).all()


def _load_peft(torch: Any, model_dir: Path, adapter_dir: Path, monkeypatch: pytest.MonkeyPatch,
               **kw: Any) -> tuple[Any, Any, Any]:
    import warnings

    from peft import PeftModel
    results: list[Any] = []
    original = PeftModel.load_adapter

    def spy(self: Any, *a: Any, **k: Any) -> Any:
        result = original(self, *a, **k)
        results.append(result)
        return result

    monkeypatch.setattr(PeftModel, "load_adapter", spy)
    base, _ = _load(model_dir, **kw)
    with torch.no_grad():
        base_logits = base(_ids(torch)).logits
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = PeftModel.from_pretrained(base, adapter_dir)
    assert not [w for w in caught if "adapter keys" in str(w.message) or "nexpected" in str(w.message)]
    assert len(results) == 1
    return pm.eval(), results[0], base_logits


@pytest.mark.parametrize("spec", EXAMPLE_ADAPTERS, ids=lambda s: s.name)
def test_peft_loads_example_adapter(hf: Any, assets: Any, spec: AdapterSpec,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from peft.utils import get_peft_model_state_dict
    torch = hf
    d = assets.adapter_dirs[spec.name]
    pm, result, base_logits = _load_peft(torch, assets.model_dir, d, monkeypatch)
    assert not [k for k in result.missing_keys if "lora_" in k]
    assert not result.unexpected_keys

    cfg = pm.peft_config["default"]
    assert (cfg.r, cfg.lora_alpha, cfg.use_rslora) == (spec.r, spec.lora_alpha, spec.use_rslora)
    assert set(cfg.target_modules) == set(spec.target_modules)

    files = load_file(d / "adapter_model.safetensors")
    loaded = get_peft_model_state_dict(pm, save_embedding_layers=False)
    assert sorted(loaded) == sorted(files)
    for name, arr in files.items():
        assert torch.equal(loaded[name], torch.from_numpy(arr)), name

    # Scaling: alpha/sqrt(r) with rsLoRA, alpha/r without; on every wrapped module.
    want = spec.lora_alpha / math.sqrt(spec.r) if spec.use_rslora else spec.lora_alpha / spec.r
    assert spec.scaling == pytest.approx(want)
    layers = pm.base_model.model.model.layers
    seen = 0
    for i, layer in enumerate(layers):
        for module in MODULES:
            kind = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            lin = getattr(getattr(layer, kind), module)
            if module in spec.target_modules:
                assert lin.scaling["default"] == pytest.approx(want)
                assert lin.r["default"] == spec.r
                # The weight change PEFT applies is scaling * B @ A, from the arrays in the file.
                prefix = f"base_model.model.model.layers.{i}.{kind}.{module}"
                a, b = files[f"{prefix}.lora_A.weight"], files[f"{prefix}.lora_B.weight"]
                np.testing.assert_allclose(lin.get_delta_weight("default").detach().numpy(),
                                           want * (b.astype(np.float64) @ a), rtol=1e-4, atol=1e-6)
                seen += 1
            else:
                assert not hasattr(lin, "lora_A")
    assert seen == len(layers) * len(spec.target_modules)

    with torch.no_grad():
        logits = pm(_ids(torch)).logits
        with pm.disable_adapter():
            off = pm(_ids(torch)).logits
    assert torch.allclose(off, base_logits, atol=1e-5)
    diff = (logits - base_logits).abs().mean().item()
    assert diff > 0.1 * base_logits.std().item(), diff


def test_rslora_and_plain_scaling_differ(hf: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = hf
    shape = ModelShape()
    model_dir = write_model(tmp_path / "model", shape)
    plain = AdapterSpec("plain", r=16, lora_alpha=8, target_modules=("q_proj",))
    rs = replace(plain, name="rs", use_rslora=True)
    for spec, want in ((plain, 8 / 16), (rs, 8 / 4)):
        d = write_adapter(tmp_path / spec.name, spec, shape, seed=0, base_model_name_or_path=str(model_dir))
        pm, _, _ = _load_peft(torch, model_dir, d, monkeypatch)
        assert pm.base_model.model.model.layers[0].self_attn.q_proj.scaling["default"] == pytest.approx(want)


def test_peft_loads_bfloat16_adapter(hf: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from peft.utils import get_peft_model_state_dict
    torch = hf
    shape = ModelShape()
    spec = EXAMPLE_ADAPTERS[-1]
    model_dir = write_model(tmp_path / "model", shape, dtype="bfloat16")
    d16 = write_adapter(tmp_path / "a16", spec, shape, seed=0, base_model_name_or_path="m", dtype="bfloat16")
    d32 = write_adapter(tmp_path / "a32", spec, shape, seed=0, base_model_name_or_path="m", dtype="float32")
    pm, result, base_logits = _load_peft(torch, model_dir, d16, monkeypatch, dtype="auto")
    assert not result.unexpected_keys and not [k for k in result.missing_keys if "lora_" in k]
    loaded = get_peft_model_state_dict(pm, save_embedding_layers=False)
    ref = load_file(d32 / "adapter_model.safetensors")
    assert sorted(loaded) == sorted(ref)
    for name, arr in ref.items():
        want = torch.from_numpy(arr).to(torch.bfloat16).float()
        assert torch.equal(loaded[name].float(), want), name
    with torch.no_grad():
        logits = pm(_ids(torch)).logits
    assert (logits.float() - base_logits.float()).abs().mean().item() > 0.1
