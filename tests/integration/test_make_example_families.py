"""`loractl make-example --family NAME`: the real CLI writes that family's checkpoint, tokenizer
and adapters; a family it has no example of is refused with the list of those it has."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

from shared.modelconfig import read_architecture
from statesvc.tools.example import FAMILIES, make_example
from statesvc.tools.tokenizer import TOKENIZERS
from testkit.fleet import BIN


def loractl(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "loractl"), *argv], capture_output=True, text=True, timeout=120)


def test_make_example_writes_the_family(tmp_path: Path) -> None:
    res = loractl("make-example", str(tmp_path / "ex"), "--family", "qwen2", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    model = Path(out["model"])
    assert out["family"] == "qwen2" and model == (tmp_path / "ex" / "model").resolve()
    cfg = json.loads((model / "config.json").read_text())
    assert (cfg["model_type"], cfg["architectures"]) == ("qwen2", ["Qwen2ForCausalLM"])
    assert read_architecture(cfg).qkv_bias
    tok = json.loads((model / "tokenizer_config.json").read_text())
    assert tok["chat_template"] == TOKENIZERS["qwen2"].chat_template and tok["eos_token"] == "<|im_end|>"
    # what the library writes for that family and seed, byte for byte
    lib = make_example(tmp_path / "lib", family="qwen2")
    assert sorted(out["adapters"]) == sorted(lib.adapter_dirs)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (model / name).read_bytes() == (lib.model_dir / name).read_bytes(), name


def test_an_unknown_family_is_refused_with_the_choices(tmp_path: Path) -> None:
    res = loractl("make-example", str(tmp_path / "ex"), "--family", "gpt2")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "Invalid value for '--family': 'gpt2' is not one of " in res.stderr, res.stderr
    for family in FAMILIES:
        assert f"'{family}'" in res.stderr, res.stderr
    assert not (tmp_path / "ex").exists()
