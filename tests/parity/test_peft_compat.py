"""Adapters as PEFT itself writes them: every target_modules form served as PEFT serves it,
every option that changes the math either served the same or refused by name with a fix.

Adapters are built with real PEFT (`get_peft_model` on the example checkpoint loaded by
transformers, LoRA weights randomised so every module counts), saved with
`save_pretrained`, loaded with the real `loractl` into a real statesvc, and followed by an
in-process replica (blob fetch, verification, slot writes). Its logits through
`forward_full` must match PEFT's own within the parity tests' tolerance (1e-4 of the logit
scale), and `resolve_targets` must name exactly the modules PEFT put LoRA on.
"""
from __future__ import annotations

import copy
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from computed.model.loader import load_model  # noqa: E402
from computed.model.runner import forward_full  # noqa: E402
from computed.replica import Replica  # noqa: E402
from shared.client import ControlClient  # noqa: E402
from shared.fingerprint import read_model  # noqa: E402
from statesvc.peft_config import OPTIONS, REFUSED, module_names, resolve_targets  # noqa: E402
from statesvc.tools.example import ExampleAssets, ModelShape, write_model  # noqa: E402
from testkit.fleet import StateSvc, loractl  # noqa: E402
from testkit.inproc import CommandError, call, init_pool, open_service  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning",
                                        "ignore::RuntimeWarning")

RTOL = 1e-4  # of the logit scale, as tests/parity/test_model_parity.py
QV = ["q_proj", "v_proj"]

# name -> LoraConfig arguments (r=4, lora_alpha=8 unless given): every form of target_modules
# PEFT accepts, and every option the pool serves.
SERVED: dict[str, dict[str, Any]] = {
    "all-linear": {"target_modules": "all-linear"},
    "suffixes": {"target_modules": ["self_attn.q_proj", "mlp.down_proj"]},
    "full-paths": {"target_modules": ["model.layers.0.self_attn.q_proj",
                                      "model.layers.1.mlp.up_proj"]},
    "regex": {"target_modules": r".*\.(k|o)_proj"},
    "regex-one-layer": {"target_modules": r"model\.layers\.1\.mlp\.(gate|up)_proj"},
    "layers-to-transform": {"target_modules": QV, "layers_to_transform": [1]},
    "layers-pattern": {"target_modules": ["gate_proj"], "layers_to_transform": 0,
                       "layers_pattern": "layers"},
    "exclude-list": {"target_modules": "all-linear",
                     "exclude_modules": ["down_proj", "model.layers.0.self_attn.q_proj"]},
    "exclude-regex": {"target_modules": QV, "exclude_modules": r"model\.layers\.1\..*"},
    "uniform-patterns": {"target_modules": QV, "rank_pattern": {"q_proj": 4},
                         "alpha_pattern": {"v_proj": 8, "nothing_targeted": 99}},
    "fan-in-fan-out": {"target_modules": QV, "fan_in_fan_out": True},
    "bias-all-no-biases": {"target_modules": QV, "bias": "all"},
    "rslora": {"target_modules": "all-linear", "use_rslora": True},
    "init-gaussian": {"target_modules": QV, "init_lora_weights": "gaussian"},
    "init-orthogonal": {"target_modules": QV, "init_lora_weights": "orthogonal"},
    "init-mica": {"target_modules": QV, "init_lora_weights": "mica"},
}


def lora_config(**kwargs: Any) -> Any:
    return peft.LoraConfig(**{"r": 4, "lora_alpha": 8, "init_lora_weights": False, **kwargs})


def randomised(model: Any, seed: int) -> Any:
    """Every LoRA matrix drawn at random, so that each targeted module changes the output."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    return model


def targeted_by_peft(model: Any) -> frozenset[tuple[int, str]]:
    pairs = set()
    for name, module in model.base_model.model.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            parts = name.split(".")
            pairs.add((int(parts[2]), parts[4]))
    return frozenset(pairs)


def logits(model: Any, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


def close(ours: Any, ref: np.ndarray) -> None:
    diff = float(np.abs(np.asarray(ours, np.float32) - ref).max()) / float(np.abs(ref).max())
    assert diff <= RTOL, f"logits differ by {diff:.2e} of the logit scale (limit {RTOL:.0e})"


@dataclass
class Built:
    dir: Path
    logits: np.ndarray               # PEFT's, for TOKENS
    targeted: frozenset[tuple[int, str]]  # the modules PEFT put LoRA on


@dataclass
class Served:
    example: ExampleAssets
    tokens: np.ndarray
    base_logits: np.ndarray
    built: dict[str, Built]
    served_logits: dict[str, np.ndarray]


@pytest.fixture(scope="module")
def base(example: ExampleAssets) -> Any:
    torch.set_num_threads(1)  # a tiny model: threads only fight XLA for the cores
    return transformers.LlamaForCausalLM.from_pretrained(
        str(example.model_dir), dtype=torch.float32, attn_implementation="eager").eval()


def build(base: Any, out: Path, seed: int, tokens: np.ndarray, **kwargs: Any) -> Built:
    model = randomised(peft.get_peft_model(copy.deepcopy(base), lora_config(**kwargs)), seed)
    model.save_pretrained(str(out))
    return Built(out, logits(model.eval(), tokens), targeted_by_peft(model))


def pissa_converted(base: Any, root: Path, tokens: np.ndarray) -> tuple[Built, Path]:
    """A PiSSA adapter saved as is (which must be refused) and converted to plain LoRA with
    PEFT's path_initial_model_for_weight_conversion, as the refusal says; PEFT's logits are
    those of the PiSSA model, with its rewritten base weights."""
    model = peft.get_peft_model(copy.deepcopy(base), lora_config(target_modules=QV,
                                                                 init_lora_weights="pissa"))
    model.peft_config["default"].init_lora_weights = True
    model.save_pretrained(str(root / "pissa-initial"))
    model.peft_config["default"].init_lora_weights = "pissa"
    with torch.no_grad():  # "training": move B away from its initial value
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.mul_(1.5)
    model.save_pretrained(str(root / "pissa-as-is"))
    model.save_pretrained(str(root / "pissa-converted"),
                          path_initial_model_for_weight_conversion=str(root / "pissa-initial"))
    return Built(root / "pissa-converted", logits(model.eval(), tokens), targeted_by_peft(model)), \
        root / "pissa-as-is"


@pytest.fixture(scope="module")
def served(example: ExampleAssets, base: Any,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("peft")
    tokens = np.random.default_rng(5).integers(0, 256, (2, 9))
    built = {name: build(base, root / name, i, tokens, **kw)
             for i, (name, kw) in enumerate(SERVED.items())}
    built["pissa-converted"], _ = pissa_converted(base, root, tokens)
    # "all-linear" as a user writes it (PEFT saves the module list it resolved)
    shutil.copytree(built["all-linear"].dir, root / "all-linear-string")
    cfg_path = root / "all-linear-string" / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["target_modules"] = "all-linear"
    cfg_path.write_text(json.dumps(cfg))
    built["all-linear-string"] = Built(root / "all-linear-string", built["all-linear"].logits,
                                       built["all-linear"].targeted)

    svc = StateSvc(root / "data").start()
    try:
        loractl(svc, "pool", "init", "--model", str(example.model_dir), "--max-loras",
                str(len(built)), "--max-rank", "16", "--targets", "all")
        for name, b in built.items():
            loractl(svc, "load", name, str(b.dir))
        with ControlClient(svc.control) as client:
            replica = Replica(read_model(example.model_dir), client, root / "replica")
            replica.bootstrap()
            replica.catch_up()
            _, params = load_model(example.model_dir)
            assert replica.pool is not None
            served_logits = {
                name: np.asarray(forward_full(params, replica.pool.arrays, tokens,
                                              [_slot_of(replica, name)] * len(tokens)))
                for name in built}
        yield Served(example, tokens, logits(base, tokens), built, served_logits)
    finally:
        svc.stop()


# --------------------------------------------------------------------------- served


@pytest.mark.parametrize("name", [*SERVED, "all-linear-string", "pissa-converted"])
def test_served_as_peft_serves_it(served: Served, name: str) -> None:
    built = served.built[name]
    close(served.served_logits[name], built.logits)
    # the adapter really counts: far beyond the tolerance from the base model
    assert np.abs(built.logits - served.base_logits).max() > 100 * RTOL * np.abs(built.logits).max()


@pytest.mark.parametrize("name", [*SERVED, "all-linear-string"])
def test_targets_resolve_to_the_modules_peft_adapts(served: Served, name: str) -> None:
    built = served.built[name]
    cfg = json.loads((built.dir / "adapter_config.json").read_text())
    assert resolve_targets(cfg, num_layers=2) == built.targeted


INERT_VALUES: dict[str, Any] = {
    "init_lora_weights": "eva", "lora_dropout": 0.3, "task_type": "CAUSAL_LM",
    "inference_mode": False, "runtime_config": {"ephemeral_gpu_offload": False},
    "megatron_core": "megatron.core", "qalora_group_size": 8, "eva_config": {"rho": 2.0},
    "future_option": None,
}


@pytest.mark.parametrize("option", sorted(INERT_VALUES))
def test_options_that_leave_the_math_alone_are_served(served: Served, base: Any, svc: Any,
                                                      tmp_path: Path, option: str) -> None:
    """PEFT loads the adapter with the option set to the same logits, and load stores the same
    weights with the same rank, alpha and targets."""
    plain = served.built["suffixes"]
    path = with_config(plain.dir, tmp_path / "a", **{option: INERT_VALUES[option]})
    model = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(path)).eval()
    close(logits(model, served.tokens), plain.logits)
    call(svc, "load", name="plain", path=str(plain.dir))
    assert call(svc, "load", name="plain", path=str(path))["created"] is False  # same content


@pytest.mark.parametrize("shape", [ModelShape(), ModelShape(num_hidden_layers=3,
                                                             tie_word_embeddings=True)])
def test_module_names_are_transformers_own(shape: ModelShape, tmp_path: Path) -> None:
    write_model(tmp_path, shape)
    model = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    assert module_names(shape.num_hidden_layers) == [n for n, _ in model.named_modules() if n]


def test_the_table_covers_every_option_of_the_installed_peft() -> None:
    import dataclasses
    fields = {f.name for f in dataclasses.fields(peft.LoraConfig)}
    assert fields <= set(OPTIONS), sorted(fields - set(OPTIONS))


# --------------------------------------------------------------------------- refused


def refused(service: Any, path: Path) -> CommandError:
    head, blobs = service.store.head(), service.blobs.all()
    with pytest.raises(CommandError) as info:
        call(service, "load", name="x", path=str(path))
    assert service.store.head() == head and service.blobs.all() == blobs
    return info.value


def with_config(src: Path, dst: Path, **changes: Any) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


def test_pissa_as_saved_is_refused_with_the_conversion(svc: Any, base: Any, tmp_path: Path) -> None:
    _, as_is = pissa_converted(base, tmp_path, np.zeros((1, 2), np.int64))
    err = refused(svc, as_is)
    assert err.code == "unsupported" and "init_lora_weights='pissa'" in str(err)
    assert "path_initial_model_for_weight_conversion" in str(err)


@pytest.mark.parametrize("init", ["pissa_niter_4", "olora", "corda", "lora_ga", "loftq", "bogus"])
def test_inits_that_rewrite_the_base_are_refused(svc: Any, served: Served, tmp_path: Path,
                                                  init: str) -> None:
    err = refused(svc, with_config(served.built["suffixes"].dir, tmp_path / "a",
                                   init_lora_weights=init))
    if init == "bogus":
        assert err.code == "invalid_adapter" and "'bogus' is not one of PEFT's" in str(err)
    elif init == "loftq":
        assert "LoftQ" in str(err) and "init_lora_weights=true" in str(err)
    else:
        assert f"init_lora_weights={init!r} is not supported" in str(err)
        assert "path_initial_model_for_weight_conversion" in str(err)


REFUSED_VALUES: dict[str, Any] = {
    "use_dora": True, "lora_bias": True, "modules_to_save": ["lm_head"],
    "trainable_token_indices": [3, 4], "layer_replication": [[0, 2], [1, 2]],
    "megatron_config": {"tensor_model_parallel_size": 2}, "use_qalora": True,
    "target_parameters": ["mlp.experts.down_proj"], "alora_invocation_tokens": [5, 6],
    "velora_config": {"rank": 2}, "monteclora_config": {"n": 2}, "use_bdlora": {"nblocks": 2},
    "arrow_config": {"top_k": 2}, "kasa_config": {"x": 1},
}


@pytest.mark.parametrize("option", sorted(REFUSED))
def test_options_that_change_the_math_are_refused_by_name(svc: Any, served: Served,
                                                          tmp_path: Path, option: str) -> None:
    err = refused(svc, with_config(served.built["suffixes"].dir, tmp_path / "a",
                                   **{option: REFUSED_VALUES[option]}))
    assert err.code == "unsupported"
    assert f"{option}={REFUSED_VALUES[option]!r} is not supported: {REFUSED[option][0]}; " \
        f"{REFUSED[option][1]}" in str(err)


def test_an_unknown_option_that_is_on_is_refused(svc: Any, served: Served, tmp_path: Path) -> None:
    off = with_config(served.built["suffixes"].dir, tmp_path / "off", future_option=None)
    assert call(svc, "load", name="off", path=str(off))["created"]
    err = refused(svc, with_config(served.built["suffixes"].dir, tmp_path / "on",
                                   future_option={"k": 1}))
    assert err.code == "unsupported" and "option 'future_option' is not supported" in str(err)


@pytest.mark.parametrize("targets, code, said", [
    (["embed_tokens"], "unsupported", "LoRA on embed_tokens is not supported"),
    (["lm_head"], "unsupported", "LoRA on lm_head is not supported"),
    (r".*lm_head", "unsupported", "LoRA on lm_head is not supported"),
    (["self_attn"], "invalid_adapter", "selects model.layers.0.self_attn, which is not a linear"),
    (["base_model.model.model.layers.0.self_attn.q_proj"], "invalid_adapter",
     "selects no module of the base model, so PEFT refuses this adapter too"),
    (r"q_proj", "invalid_adapter", "selects no module of the base model"),
])
def test_targets_peft_or_the_pool_cannot_serve(svc: Any, served: Served, tmp_path: Path,
                                               targets: Any, code: str, said: str) -> None:
    err = refused(svc, with_config(served.built["suffixes"].dir, tmp_path / "a",
                                   target_modules=targets))
    assert err.code == code and said in str(err)
    assert "--targets" not in str(err)  # no pool holds these: the fix is in the adapter


@pytest.mark.parametrize("changes, said", [
    ({"target_modules": "all-linear", "layers_to_transform": [0]},
     "layers_to_transform and layers_pattern do not apply to a target_modules string"),
    ({"layers_pattern": "layers"}, "layers_pattern needs layers_to_transform"),
])
def test_configs_peft_refuses_are_refused(svc: Any, served: Served, tmp_path: Path,
                                          changes: dict[str, Any], said: str) -> None:
    with pytest.raises(ValueError):  # PEFT's own refusal
        peft.LoraConfig(**changes)
    err = refused(svc, with_config(served.built["suffixes"].dir, tmp_path / "a", **changes))
    assert err.code == "invalid_adapter" and said in str(err)


def test_weights_peft_would_ignore_are_refused(svc: Any, served: Served, tmp_path: Path) -> None:
    err = refused(svc, with_config(served.built["suffixes"].dir, tmp_path / "a",
                                   layers_to_transform=[1]))
    assert "holds LoRA weights for layer 0 down_proj, which target_modules" in str(err)
    assert "PEFT would load the adapter without them" in str(err)


@pytest.mark.parametrize("init, served_as_zero", [(True, True), ("gaussian", True),
                                                   (False, False), ("orthogonal", False)])
def test_a_selected_module_without_weights(svc: Any, served: Served, tmp_path: Path,
                                           init: Any, served_as_zero: bool) -> None:
    """PEFT leaves such a module at its initial value: zero for most inits, random for some."""
    path = with_config(served.built["suffixes"].dir, tmp_path / "a", init_lora_weights=init,
                       target_modules=["self_attn.q_proj", "mlp.down_proj", "k_proj"])
    if served_as_zero:
        assert call(svc, "load", name="ok", path=str(path))["created"]
        return
    err = refused(svc, path)
    assert "selects layer 0 k_proj, but adapter_model.safetensors holds no weights" in str(err)
    assert "PEFT would give it random ones" in str(err)


def test_a_rank_pattern_that_differs_is_refused(svc: Any, served: Served, tmp_path: Path) -> None:
    err = refused(svc, with_config(served.built["suffixes"].dir, tmp_path / "a",
                                   rank_pattern={r"layers\.1\.mlp\.down_proj": 2}))
    assert err.code == "unsupported"
    assert "gives model.layers.1.mlp.down_proj rank 2 where the adapter's r is 4" in str(err)


def test_bias_is_refused_where_the_base_model_has_biases(served: Served, tmp_path: Path) -> None:
    model = tmp_path / "model"
    _write_biased_model(model)
    service = open_service(tmp_path / "data")
    try:
        init_pool(service, model, max_rank=16)
        err = refused(service, served.built["bias-all-no-biases"].dir)
        assert err.code == "unsupported" and "bias='all' is not supported" in str(err)
        assert "retrain with bias='none'" in str(err)
    finally:
        service.store.close()


def _write_biased_model(model: Path) -> None:
    from safetensors.numpy import load_file, save_file
    write_model(model, ModelShape())
    cfg = json.loads((model / "config.json").read_text())
    cfg["attention_bias"] = True
    (model / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(model / "model.safetensors"))
    for name in list(tensors):
        if ".self_attn." in name:
            tensors[name.replace(".weight", ".bias")] = np.zeros(tensors[name].shape[0], np.float32)
    save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})


def test_targets_outside_the_pool_name_a_fix_that_works(served: Served, example: ExampleAssets,
                                                        tmp_path: Path) -> None:
    narrow = open_service(tmp_path / "narrow")
    wide = open_service(tmp_path / "wide")
    try:
        init_pool(narrow, example.model_dir, targets=QV)
        err = refused(narrow, served.built["suffixes"].dir)
        assert "selects down_proj, which the pool does not hold (pool targets: q_proj, v_proj)" \
            in str(err)
        assert "configure a new pool (a new --data-dir) with --targets including them" in str(err)
        init_pool(wide, example.model_dir, targets=["q_proj", "v_proj", "down_proj"])
        assert call(wide, "load", name="ok", path=str(served.built["suffixes"].dir))["created"]
    finally:
        narrow.store.close()
        wide.store.close()


def _slot_of(replica: Replica, name: str) -> int:
    """The slot the replica filled with `name` (replay fills free slots: computed/residency/slots.py)."""
    return next(s for s, h in replica.holders.items() if h.name == name)
