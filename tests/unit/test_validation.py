"""Every refusal of `load`: a message that says what is wrong, and nothing stored."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
from safetensors.numpy import load_file, save, save_file

from statesvc import adapters
from statesvc.service import StateService
from statesvc.tools.example import ExampleAssets, encode_safetensors
from testkit.inproc import CommandError, call, init_pool, open_service

QV = "attn-qv-r8"          # r=8, q_proj and v_proj
ALL = "all-r2"             # r=2, all seven modules
A_NAME = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
B_NAME = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


def variant(example: ExampleAssets, tmp_path: Path, base: str = QV, *,
            config: Callable[[dict[str, Any]], None] | None = None,
            tensors: Callable[[dict[str, np.ndarray]], None] | None = None) -> Path:
    """A copy of an example adapter with its config and/or tensors changed."""
    dst = tmp_path / f"variant-{len(list(tmp_path.glob('variant-*')))}"
    shutil.copytree(example.adapter_dirs[base], dst)
    if config is not None:
        cfg = json.loads((dst / "adapter_config.json").read_text())
        config(cfg)
        (dst / "adapter_config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        t = load_file(str(dst / "adapter_model.safetensors"))
        tensors(t)
        save_file(t, str(dst / "adapter_model.safetensors"), metadata={"format": "pt"})
    return dst


def refused(svc: StateService, path: Path, *, name: str = "x", **kw: Any) -> CommandError:
    """Load must fail, and neither the log nor the blob store may change."""
    head, blobs = svc.store.head(), svc.blobs.all()
    with pytest.raises(CommandError) as info:
        call(svc, "load", name=name, path=str(path), **kw)
    assert svc.store.head() == head
    assert svc.blobs.all() == blobs
    assert not any(svc.blobs.tmp.iterdir())
    return info.value


def set_key(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda cfg: cfg.__setitem__(key, value)


def test_valid_adapter_is_recorded_with_its_blob(svc: StateService, example: ExampleAssets) -> None:
    res = call(svc, "load", name="ok", path=str(example.adapter_dirs[QV]))
    assert res == {"seq": 2, "name": "ok", "version": 2, "created": True}
    [sha] = svc.blobs.all()
    assert svc.blobs.verify(sha)


@pytest.mark.parametrize("name", ["", "-lead", ".hidden", "a/b", "sp ace", "x" * 65, "é"])
def test_bad_names(svc: StateService, example: ExampleAssets, name: str) -> None:
    if name == "" or len(name) > 64:  # refused by the frame schema before the command runs
        with pytest.raises(Exception, match="args.name"):
            call(svc, "load", name=name, path=str(example.adapter_dirs[QV]))
        return
    err = refused(svc, example.adapter_dirs[QV], name=name)
    assert err.code == "invalid_name" and "[A-Za-z0-9]" in str(err)


def test_not_a_directory(svc: StateService, tmp_path: Path) -> None:
    err = refused(svc, tmp_path / "missing")
    assert "no such directory" in str(err)


def test_no_adapter_config(svc: StateService, example: ExampleAssets, tmp_path: Path) -> None:
    path = variant(example, tmp_path)
    (path / "adapter_config.json").unlink()
    assert "no adapter_config.json" in str(refused(svc, path))


def test_config_not_json(svc: StateService, example: ExampleAssets, tmp_path: Path) -> None:
    path = variant(example, tmp_path)
    (path / "adapter_config.json").write_text("{not json")
    assert "not valid JSON" in str(refused(svc, path))


def test_not_lora(svc: StateService, example: ExampleAssets, tmp_path: Path) -> None:
    err = refused(svc, variant(example, tmp_path, config=set_key("peft_type", "IA3")))
    assert "peft_type is 'IA3'" in str(err) and "only LORA" in str(err)


def test_pickle_bin_refused(svc: StateService, example: ExampleAssets, tmp_path: Path) -> None:
    path = variant(example, tmp_path)
    (path / "adapter_model.safetensors").rename(path / "adapter_model.bin")
    err = refused(svc, path)
    assert err.code == "unsupported"
    assert "pickle" in str(err) and "safe_serialization=True" in str(err)


def test_no_weights(svc: StateService, example: ExampleAssets, tmp_path: Path) -> None:
    path = variant(example, tmp_path)
    (path / "adapter_model.safetensors").unlink()
    assert "no adapter_model.safetensors" in str(refused(svc, path))


def test_rank_above_pool(svc: StateService, example: ExampleAssets) -> None:
    err = refused(svc, example.adapter_dirs["all-r32-rslora"])
    assert "rank 32 is above the pool's --max-rank 16" in str(err)
    assert "larger --max-rank" in str(err)


def test_targets_outside_pool(tmp_path: Path, example: ExampleAssets) -> None:
    svc = open_service(tmp_path / "data")
    init_pool(svc, example.model_dir, targets=["q_proj", "v_proj"])
    err = refused(svc, example.adapter_dirs[ALL])
    assert "target_modules selects k_proj, o_proj, gate_proj, up_proj, down_proj, which the " \
        "pool does not hold (pool targets: q_proj, v_proj)" in str(err)
    assert "--targets" in str(err)


def test_tensors_outside_pool_even_if_config_is_vague(tmp_path: Path,
                                                      example: ExampleAssets) -> None:
    svc = open_service(tmp_path / "data")
    init_pool(svc, example.model_dir, targets=["q_proj", "v_proj"])
    path = variant(example, tmp_path, ALL, config=set_key("target_modules", r".*\.(q|v)_proj"))
    err = refused(svc, path)
    assert "which the pool does not hold (pool targets: q_proj, v_proj)" in str(err)


@pytest.mark.parametrize("bad_name, why", [
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight",
     "is not a LoRA weight of a Llama layer"),
    ("base_model.model.model.layers.0.mlp.q_proj.lora_A.weight",
     "is not a LoRA weight of a Llama layer"),
    ("base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight",
     "is for layer 9, but the base model has 2 layers"),
])
def test_tensor_names(svc: StateService, example: ExampleAssets, tmp_path: Path,
                      bad_name: str, why: str) -> None:
    def rename(t: dict[str, np.ndarray]) -> None:
        t[bad_name] = t.pop(A_NAME)
    err = refused(svc, variant(example, tmp_path, tensors=rename))
    assert why in str(err) and bad_name in str(err)


def test_unpaired_tensor(svc: StateService, example: ExampleAssets, tmp_path: Path) -> None:
    err = refused(svc, variant(example, tmp_path, tensors=lambda t: t.pop(B_NAME)))
    assert "has no matching lora_B" in str(err)


@pytest.mark.parametrize("which, shape", [(A_NAME, (8, 63)), (B_NAME, (64, 7))])
def test_shapes(svc: StateService, example: ExampleAssets, tmp_path: Path, which: str,
                shape: tuple[int, int]) -> None:
    def reshape(t: dict[str, np.ndarray]) -> None:
        t[which] = np.zeros(shape, np.float32)
    err = refused(svc, variant(example, tmp_path, tensors=reshape))
    assert f"has shape {list(shape)}, expected" in str(err)


def test_dtype(svc: StateService, example: ExampleAssets, tmp_path: Path) -> None:
    def widen(t: dict[str, np.ndarray]) -> None:
        t[A_NAME] = t[A_NAME].astype(np.float64)
    err = refused(svc, variant(example, tmp_path, tensors=widen))
    assert "dtype F64; use F32, F16 or BF16" in str(err)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_f32(svc: StateService, example: ExampleAssets, tmp_path: Path,
                        bad: float) -> None:
    def poison(t: dict[str, np.ndarray]) -> None:
        t[B_NAME] = t[B_NAME].copy()
        t[B_NAME][3, 1] = bad
    err = refused(svc, variant(example, tmp_path, tensors=poison))
    assert "contains NaN or Inf" in str(err) and B_NAME in str(err)


@pytest.mark.parametrize("dtype, bits", [("F16", 0x7E00), ("BF16", 0x7FC0), ("BF16", 0xFF80)])
def test_non_finite_half(svc: StateService, example: ExampleAssets, tmp_path: Path,
                         dtype: str, bits: int) -> None:
    path = variant(example, tmp_path)
    t = load_file(str(path / "adapter_model.safetensors"))
    entries = {}
    for name, arr in t.items():
        raw = np.zeros(arr.shape, "<u2")  # zeros are finite in both formats
        if name == B_NAME:
            raw.flat[5] = bits
        entries[name] = (dtype, arr.shape, raw.tobytes())
    (path / "adapter_model.safetensors").write_bytes(encode_safetensors(entries))
    assert "contains NaN or Inf" in str(refused(svc, path))


def test_half_precision_accepted(svc: StateService, example: ExampleAssets,
                                 tmp_path: Path) -> None:
    def halve(t: dict[str, np.ndarray]) -> None:
        for k in t:
            t[k] = t[k].astype(np.float16)
    res = call(svc, "load", name="half", path=str(variant(example, tmp_path, tensors=halve)))
    assert res["created"]


def test_lying_header(svc: StateService, example: ExampleAssets, tmp_path: Path) -> None:
    path = variant(example, tmp_path)
    data = bytearray((path / "adapter_model.safetensors").read_bytes())
    (path / "adapter_model.safetensors").write_bytes(bytes(data[:-16]))  # truncated
    assert "fall outside" in str(refused(svc, path))


@pytest.mark.parametrize("key, value, named", [
    ("use_dora", True, "use_dora=True"),
    ("modules_to_save", ["lm_head"], "modules_to_save=['lm_head']"),
    ("rank_pattern", {"q_proj": 4}, "rank_pattern {'q_proj': 4}"),
    ("alpha_pattern", {"q_proj": 4}, "alpha_pattern {'q_proj': 4}"),
    ("trainable_token_indices", [5, 6], "trainable_token_indices=[5, 6]"),
    ("lora_bias", True, "lora_bias=True"),
])
def test_unsupported_options_refused_by_name(svc: StateService, example: ExampleAssets,
                                             tmp_path: Path, key: str, value: Any,
                                             named: str) -> None:
    err = refused(svc, variant(example, tmp_path, config=set_key(key, value)))
    assert err.code == "unsupported"
    assert f"{named} is not supported: " in str(err)


def test_added_tokens_file(svc: StateService, example: ExampleAssets, tmp_path: Path) -> None:
    path = variant(example, tmp_path)
    (path / "added_tokens.json").write_text('{"<new>": 256}')
    assert "added_tokens.json is not supported" in str(refused(svc, path))


def test_embedding_tensor_is_refused(svc: StateService, example: ExampleAssets,
                                     tmp_path: Path) -> None:
    def add(t: dict[str, np.ndarray]) -> None:
        t["base_model.model.model.embed_tokens.weight"] = np.zeros((260, 64), np.float32)
    err = refused(svc, variant(example, tmp_path, tensors=add))
    assert err.code == "unsupported" and "save_embedding_layers=False" in str(err)


@pytest.mark.parametrize("key, value, why", [
    ("r", 0, "r must be a positive integer"),
    ("r", "8", "r must be a positive integer"),
    ("lora_alpha", -1, "lora_alpha must be a positive number"),
])
def test_bad_numbers(svc: StateService, example: ExampleAssets, tmp_path: Path, key: str,
                     value: Any, why: str) -> None:
    assert why in str(refused(svc, variant(example, tmp_path, config=set_key(key, value))))


def test_rank_disagrees_with_weights(svc: StateService, example: ExampleAssets,
                                     tmp_path: Path) -> None:
    err = refused(svc, variant(example, tmp_path, config=set_key("r", 4)))
    assert "expected [4, 64]" in str(err)


def test_registry_full_names_max_adapters(tmp_path: Path, example: ExampleAssets) -> None:
    svc = open_service(tmp_path / "data")
    init_pool(svc, example.model_dir, max_loras=1, max_adapters=2)
    assert call(svc, "list")["pool"]["max_adapters"] == 2
    # more adapters than slots: --max-loras is slots per replica, not a registry cap
    call(svc, "load", name="a", path=str(example.adapter_dirs[QV]))
    call(svc, "load", name="b", path=str(example.adapter_dirs[ALL]))
    err = refused(svc, example.adapter_dirs["attn-all-r4"], name="c")
    assert err.code == "registry_full"
    assert "holds 2 adapters" in str(err) and "--max-adapters" in str(err)
    # the reducer refuses before any file is read: a missing directory is not looked at
    assert refused(svc, tmp_path / "missing", name="c").code == "registry_full"
    # a new version of a registered name is no new entry
    call(svc, "load", name="a", path=str(example.adapter_dirs["attn-all-r4"]), replace=True)
    call(svc, "unload", name="b")
    call(svc, "load", name="c", path=str(example.adapter_dirs["attn-all-r4"]))


def test_at_most_max_loras_minus_one_pinned(tmp_path: Path, example: ExampleAssets) -> None:
    svc = open_service(tmp_path / "data")
    init_pool(svc, example.model_dir, max_loras=3)
    call(svc, "load", name="a", path=str(example.adapter_dirs[QV]), pin=True)
    call(svc, "load", name="b", path=str(example.adapter_dirs[ALL]), pin=True)
    err = refused(svc, example.adapter_dirs["attn-all-r4"], name="c", pin=True)
    assert err.code == "too_many_pinned" and err.field == "args.pin"
    assert "2 adapters are already pinned" in str(err) and "one slot must always cycle" in str(err)
    assert refused(svc, tmp_path / "missing", name="c", pin=True).code == "too_many_pinned"
    call(svc, "load", name="c", path=str(example.adapter_dirs["attn-all-r4"]))  # unpinned: fine
    # a pinned name's new version stays within the limit; unloading one makes room
    call(svc, "load", name="a", path=str(example.adapter_dirs["mlp-only-r16"]), pin=True,
         replace=True)
    call(svc, "unload", name="b", force=True)
    call(svc, "load", name="d", path=str(example.adapter_dirs[ALL]), pin=True)
    assert sorted(a.name for a in svc.state.pinned()) == ["a", "d"]


def test_same_name_other_content_needs_replace(svc: StateService,
                                               example: ExampleAssets) -> None:
    call(svc, "load", name="a", path=str(example.adapter_dirs[QV]))
    err = refused(svc, example.adapter_dirs[ALL], name="a")
    assert err.code == "exists" and "--replace" in str(err)


def test_same_name_same_content_returns_existing(svc: StateService,
                                                 example: ExampleAssets) -> None:
    first = call(svc, "load", name="a", path=str(example.adapter_dirs[QV]))
    head = svc.store.head()
    again = call(svc, "load", name="a", path=str(example.adapter_dirs[QV]))
    assert (again["version"], again["created"]) == (first["version"], False)
    assert svc.store.head() == head


def test_replace_records_one_event(svc: StateService,
                                                  example: ExampleAssets) -> None:
    call(svc, "load", name="a", path=str(example.adapter_dirs[QV]))
    head = svc.store.head()
    res = call(svc, "load", name="a", path=str(example.adapter_dirs[ALL]), replace=True)
    assert svc.store.head() == head + 1
    assert res == {"seq": head + 1, "name": "a", "version": head + 1, "created": True}
    [ev] = svc.store.read(head, 10)
    assert ev.payload["replaces"] == {"version": 2} and "slot" not in ev.payload
    assert svc.state.adapters["a"].version == head + 1 and len(svc.state.adapters) == 1


def test_load_before_pool_init(tmp_path: Path, example: ExampleAssets) -> None:
    svc = open_service(tmp_path / "data")
    err = refused(svc, example.adapter_dirs[QV])
    assert err.code == "not_configured" and "loractl pool init" in str(err)


def test_relative_path_refused(svc: StateService) -> None:
    with pytest.raises(CommandError, match="must be an absolute path"):
        call(svc, "load", name="a", path="relative/dir")
    assert svc.store.head() == 1


def test_oversized_weights(tmp_path: Path, example: ExampleAssets) -> None:
    svc = open_service(tmp_path / "data")
    init_pool(svc, example.model_dir)
    svc.max_adapter_bytes = 1000
    err = refused(svc, example.adapter_dirs[QV])
    assert "above the 1000-byte limit" in str(err)
    size = (example.adapter_dirs[QV] / "adapter_model.safetensors").stat().st_size
    assert str(size) not in str(err)  # what statesvc read of a file is never quoted


def test_reloading_same_content_repairs_a_damaged_blob(svc: StateService,
                                                       example: ExampleAssets) -> None:
    call(svc, "load", name="a", path=str(example.adapter_dirs[QV]))
    [sha] = svc.blobs.all()
    svc.blobs.path(sha).write_bytes(b"damaged")
    head = svc.store.head()
    again = call(svc, "load", name="a", path=str(example.adapter_dirs[QV]))
    assert again["created"] is False and svc.store.head() == head
    assert svc.blobs.verify(sha)


def test_an_adapter_rewritten_in_place_is_read_again(svc: StateService, example: ExampleAssets,
                                                     tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A load of a directory unchanged since an earlier load may skip reading it; one whose
    weights were rewritten (same size, mtime put back) is hashed again, at once."""
    monkeypatch.setattr(adapters, "RACY_NS", 50_000_000)  # settled after 50 ms, not 2 s
    reads: list[Path] = []
    inspect = adapters._inspect
    monkeypatch.setattr(adapters, "_inspect", lambda p, *a: reads.append(p) or inspect(p, *a))
    d = variant(example, tmp_path)
    time.sleep(0.1)
    call(svc, "load", name="a", path=str(d))
    call(svc, "load", name="b", path=str(d))
    assert len(reads) == 1  # unchanged and stored: not read again
    weights = d / "adapter_model.safetensors"
    before = weights.stat()
    t = load_file(str(weights))
    t[A_NAME] = t[A_NAME] * 2
    with weights.open("r+b") as f:  # in place: same inode, same size, mtime put back
        f.write(save(t, metadata={"format": "pt"}))
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = weights.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size,
                                                                before.st_mtime_ns)
    call(svc, "load", name="c", path=str(d))
    a, b, c = (svc.state.adapters[n] for n in "abc")
    assert a.sha256 == b.sha256 != c.sha256 == hashlib.sha256(weights.read_bytes()).hexdigest()
    assert svc.blobs.verify(c.sha256) and len(reads) == 2


def test_list_pages_through_the_registry(tmp_path: Path, example: ExampleAssets) -> None:
    from shared.client import list_adapters  # the loop loractl and the drill page with

    svc = open_service(tmp_path / "data")
    init_pool(svc, example.model_dir, max_loras=2)
    names = [f"n{i:02d}" for i in range(7)]
    for name in reversed(names):
        call(svc, "load", name=name, path=str(example.adapter_dirs[QV]))
    first = call(svc, "list", limit=3)
    assert [a["name"] for a in first["adapters"]] == names[:3]
    assert (first["count"], first["next_after"]) == (7, "n02")
    rest = call(svc, "list", after="n02", limit=10)
    assert [a["name"] for a in rest["adapters"]] == names[3:] and rest["next_after"] is None
    assert call(svc, "list", after="zzz")["adapters"] == []

    class Paged:  # the service behind the client's call, three adapters a page
        def call(self, cmd: str, args: dict[str, Any]) -> Any:
            return call(svc, cmd, **{**args, "limit": min(args["limit"], 3)})

    assert [a["name"] for a in list_adapters(Paged())[1]] == names  # type: ignore[arg-type]
    assert [a["name"] for a in list_adapters(Paged(), after="n01", limit=4)[1]] == names[2:6]  # type: ignore[arg-type]
    err = refused_read(svc, "list", limit=0)
    assert err.code == "bad_request" and err.field == "args.limit"


def refused_read(svc: StateService, cmd: str, **args: Any) -> CommandError:
    from shared.protocol import ProtocolError
    try:
        call(svc, cmd, **args)
    except (CommandError, ProtocolError) as exc:
        return CommandError(exc.code, str(exc), exc.field)
    raise AssertionError(f"{cmd} {args} was answered")
