"""Reading adapter files safely: what is read is what was checked (no symlink race out of
--adapter-root), layouts checked before any tensor is read (gaps, trailing bytes, sparse
files that lie), heartbeats while a large adapter is validated, scalings the pool can hold,
and blob writes the disk refuses."""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import struct
import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from safetensors.numpy import load_file, save_file

from shared.client import ControlClient, RemoteError, new_event_id
from shared.projections import MODULE_PARENT
from statesvc.tools.example import (AdapterSpec, ExampleAssets, ModelShape, adapter_config,
                              adapter_tensor_names, model_config, model_tensor_names)
from statesvc.service import StateService
from testkit.fleet import StateSvc, memory_kb
from testkit.inproc import CommandError, call, init_pool, open_service

pytestmark = pytest.mark.timeout(300)

QV, ALL = "attn-qv-r8", "all-r2"
WEIGHTS = "adapter_model.safetensors"


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def new_pool(c: ControlClient, model_dir: Path, **overrides: Any) -> None:
    c.call("pool.init", {"event_id": new_event_id(), "model": str(model_dir), "max_loras": 4,
                         "max_rank": 16, "targets": "all", **overrides})


def load(c: ControlClient, name: str, path: Path, **overrides: Any) -> Any:
    return c.call("load", {"event_id": new_event_id(), "name": name, "path": str(path),
                           **overrides})


def refused(svc: StateService, path: Path | str) -> CommandError:
    """Load must fail, and neither the log nor the blob store may change."""
    head, blobs = svc.store.head(), svc.blobs.all()
    with pytest.raises(CommandError) as info:
        call(svc, "load", name="x", path=str(path))
    assert svc.store.head() == head and svc.blobs.all() == blobs
    assert not any(svc.blobs.tmp.iterdir())
    return info.value


# ---- item 3: paths ---------------------------------------------------------------------------


def test_a_symlink_flipped_during_loads_never_lets_a_load_escape_the_root(
        tmp_path: Path, example: ExampleAssets) -> None:
    """Loads race a thread that flips symlinks (of the directory, and of the weights file)
    between an adapter inside the root and one outside: each load reads the inside adapter
    or is refused; the outside one's sha256 is never recorded."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    shutil.copytree(example.adapter_dirs[QV], root / "inside")
    shutil.copytree(example.adapter_dirs[QV], outside)  # the same settings, other weights
    weights = load_file(str(outside / WEIGHTS))
    save_file({k: v * 2 for k, v in weights.items()}, str(outside / WEIGHTS))
    (root / "file-flip").mkdir()
    shutil.copy(outside / "adapter_config.json", root / "file-flip")
    inside_sha, outside_sha = sha256_of(root / "inside" / WEIGHTS), sha256_of(outside / WEIGHTS)
    flips = {root / "dir-flip": ("inside", str(outside)),
             root / "file-flip" / WEIGHTS: ("../inside/" + WEIGHTS, str(outside / WEIGHTS))}
    for link, (target, _) in flips.items():
        link.symlink_to(target)
    stop = threading.Event()

    def flip() -> None:
        n = 0
        while not stop.is_set():
            for link, targets in flips.items():
                tmp = link.with_name(link.name + ".new")
                tmp.symlink_to(targets[n % 2])
                os.replace(tmp, link)  # atomic: the link always exists
            n += 1

    svc = StateSvc(tmp_path / "data", extra_args=("--adapter-root", str(root))).start()
    flipper = threading.Thread(target=flip, daemon=True)
    outcomes: dict[str, int] = {}
    try:
        with ControlClient(svc.control, timeout_s=30) as c:
            new_pool(c, example.model_dir)
            flipper.start()
            deadline = time.monotonic() + 60
            for i in range(600):
                if time.monotonic() > deadline:
                    break
                try:
                    load(c, "x", root / ("dir-flip", "file-flip")[i % 2], replace=True)
                    outcomes["loaded"] = outcomes.get("loaded", 0) + 1
                except RemoteError as exc:
                    assert exc.code == "forbidden" and "resolves to" in str(exc), exc
                    assert "--adapter-root" in str(exc)
                    outcomes["forbidden"] = outcomes.get("forbidden", 0) + 1
            stop.set()
            flipper.join()
            events = c.call("events", {"since": 0, "limit": 1000})["events"]
    finally:
        stop.set()
        svc.stop()
    recorded = {e["payload"]["sha256"] for e in events if e["type"] == "adapter.loaded"}
    assert outside_sha not in recorded, f"a load escaped the root ({outcomes})"
    assert recorded == {inside_sha}
    assert outcomes.get("loaded") and outcomes.get("forbidden"), outcomes  # both sides raced


def test_symlinks_that_stay_under_the_root_are_followed(svc: StateService, example: ExampleAssets,
                                                        tmp_path: Path) -> None:
    """A Hugging Face cache layout (snapshot files linking to ../../blobs) loads from under
    --adapter-root; a link whose target climbs out of the root is refused, naming where it
    leads."""
    root = tmp_path / "hub"
    repo = root / "models--me--qv"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for name in ("adapter_config.json", WEIGHTS):
        blob = blobs / hashlib.sha256(name.encode()).hexdigest()
        shutil.copy(example.adapter_dirs[QV] / name, blob)
        (snapshot / name).symlink_to(Path("../../blobs") / blob.name)
    (root / "latest").symlink_to(snapshot)  # absolute, inside
    svc.adapter_roots = (root,)
    for name, path in (("hf", snapshot), ("latest", root / "latest")):
        assert call(svc, "load", name=name, path=str(path))["created"]
    assert svc.state.adapters["latest"].sha256 == sha256_of(example.adapter_dirs[QV] / WEIGHTS)

    climbing = root / "climbing"
    climbing.mkdir()
    shutil.copy(example.adapter_dirs[QV] / "adapter_config.json", climbing)
    shutil.copy(example.adapter_dirs[ALL] / WEIGHTS, tmp_path / "secret.safetensors")
    (climbing / WEIGHTS).symlink_to("../../secret.safetensors")
    err = refused(svc, climbing)
    assert err.code == "forbidden"
    assert f"{climbing / WEIGHTS} is outside the adapter roots (it resolves to " \
           f"{tmp_path / 'secret.safetensors'})" in str(err)
    assert "--adapter-root" in str(err)


def test_without_roots_an_adapters_files_must_be_inside_its_directory(
        svc: StateService, example: ExampleAssets, tmp_path: Path) -> None:
    """Without --adapter-root statesvc reads any directory its user may read, but an adapter's
    files only from inside that directory: a weights file or a config linking out of it (to a
    secret statesvc can read and its caller cannot) is refused as `forbidden` naming the file
    and args.path, and no error quotes what a file holds or how large it is. A link that stays
    inside the directory is followed."""
    secret = tmp_path / "shadow"
    secret.write_bytes(b"root:*:20000:0:99999:7:::\n" * 40)
    claimed = str(struct.unpack("<Q", secret.read_bytes()[:8])[0])  # what the header read was
    for i, (name, target) in enumerate(((WEIGHTS, secret), (WEIGHTS, Path("../shadow")),
                                        ("adapter_config.json", secret))):
        d = tmp_path / f"link-{i}"
        shutil.copytree(example.adapter_dirs[QV], d)
        (d / name).unlink()
        (d / name).symlink_to(target)
        err = refused(svc, d)
        assert (err.code, err.field) == ("forbidden", "args.path"), str(err)
        assert f"{name} is a symlink to {secret}, outside the adapter directory" in str(err)
        assert claimed not in str(err) and str(secret.stat().st_size) not in str(err)
    # a file that is no safetensors file: refused without its bytes or its size
    d = tmp_path / "not-weights"
    shutil.copytree(example.adapter_dirs[QV], d)
    shutil.copy(secret, d / WEIGHTS)
    err = refused(svc, d)
    assert err.code == "invalid_adapter" and err.field == "args.path"
    assert "the header's length" in str(err), str(err)
    assert claimed not in str(err) and str(secret.stat().st_size) not in str(err)
    # inside the directory, a link is followed
    inside = tmp_path / "inside"
    shutil.copytree(example.adapter_dirs[QV], inside)
    (inside / "weights").mkdir()
    (inside / WEIGHTS).rename(inside / "weights" / "w.safetensors")
    (inside / WEIGHTS).symlink_to("weights/w.safetensors")
    assert call(svc, "load", name="inside", path=str(inside))["created"]


@pytest.mark.parametrize("cmd", ["load", "pool.init"])
def test_nul_bytes_in_paths_are_bad_requests(svc: StateService, example: ExampleAssets,
                                             tmp_path: Path, cmd: str) -> None:
    svc.adapter_roots = (tmp_path,)
    head = svc.store.head()
    field = "path" if cmd == "load" else "model"
    args = {"name": "x"} if cmd == "load" else {"max_loras": 2, "max_rank": 8, "targets": "all"}
    with pytest.raises(CommandError) as info:
        call(svc, cmd, **args, **{field: f"{tmp_path}/a\0b"})
    assert info.value.code == "bad_request" and info.value.field == f"args.{field}"
    assert "contains a NUL byte" in str(info.value)
    assert svc.store.head() == head


# ---- item 6: layouts checked first, from the fd; streaming; heartbeats -------------------------


def _entries(path: Path) -> tuple[dict[str, Any], bytes]:
    """The header (without __metadata__) and the data section of a safetensors file."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    return header, raw[8 + n:]


def _encode(header: dict[str, Any], data: bytes) -> bytes:
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head + data


def test_weights_with_a_gap_between_tensors_are_refused(svc: StateService,
                                                        example: ExampleAssets,
                                                        tmp_path: Path) -> None:
    d = tmp_path / "gap"
    shutil.copytree(example.adapter_dirs[QV], d)
    header, data = _entries(d / WEIGHTS)
    order = sorted(header, key=lambda n: header[n]["data_offsets"])
    cut = header[order[0]]["data_offsets"][1]
    for name in order[1:]:  # 16 unused bytes after the first tensor
        header[name]["data_offsets"] = [o + 16 for o in header[name]["data_offsets"]]
    (d / WEIGHTS).write_bytes(_encode(header, data[:cut] + bytes(16) + data[cut:]))
    err = refused(svc, d)
    assert err.code == "invalid_adapter"
    assert f"a gap of 16 bytes before tensor {order[1]!r}" in str(err)


def test_weights_with_trailing_bytes_are_refused(svc: StateService, example: ExampleAssets,
                                                 tmp_path: Path) -> None:
    d = tmp_path / "tail"
    shutil.copytree(example.adapter_dirs[QV], d)
    with (d / WEIGHTS).open("ab") as f:
        f.write(bytes(28 << 10))
    err = refused(svc, d)
    assert err.code == "invalid_adapter"
    assert f"{28 << 10} bytes follow the last tensor" in str(err)


def test_a_big_sparse_file_that_lies_is_refused_before_it_is_read(
        tmp_path: Path, example: ExampleAssets) -> None:
    """1 GiB sparse weights, once as a real adapter followed by a hole and once as a header
    claiming one 1 GiB tensor: both refused, and statesvc's peak RSS does not grow by what
    the files hold."""
    size = 1 << 30
    tail = tmp_path / "tail"
    shutil.copytree(example.adapter_dirs[QV], tail)
    os.truncate(tail / WEIGHTS, size)
    claims = tmp_path / "claims"
    shutil.copytree(example.adapter_dirs[QV], claims)
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    head = b""
    for _ in range(2):  # the header's own length decides the data's
        head = json.dumps({name: {"dtype": "U8", "shape": [size - 8 - len(head)],
                                  "data_offsets": [0, size - 8 - len(head)]}}).encode()
    with (claims / WEIGHTS).open("wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        f.truncate(size)
    svc = StateSvc(tmp_path / "data").start()
    try:
        assert svc.proc is not None
        with ControlClient(svc.control, timeout_s=60) as c:
            new_pool(c, example.model_dir)
            before = memory_kb(svc.proc.pid, "VmHWM") * 1024
            for path, why in ((tail, "bytes follow the last tensor"),
                              (claims, "has dtype U8; use F32, F16 or BF16")):
                with pytest.raises(RemoteError) as info:
                    load(c, "x", path)
                assert info.value.code == "invalid_adapter" and why in str(info.value)
            grown = memory_kb(svc.proc.pid, "VmHWM") * 1024 - before
            assert c.call("status")["head_seq"] == 1
    finally:
        svc.stop()
    assert grown < size // 4, f"peak RSS grew by {grown} bytes refusing a {size}-byte file"


def _sparse_safetensors(path: Path, entries: dict[str, tuple[int, ...]]) -> None:
    """A valid F32 safetensors file of zeros (sparse: nothing is written but the header)."""
    header, offset = {}, 0
    for name in sorted(entries):
        n = math.prod(entries[name]) * 4
        header[name] = {"dtype": "F32", "shape": list(entries[name]),
                        "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        f.truncate(8 + len(head) + offset)


def _lora_shape(shape: ModelShape, spec: AdapterSpec, name: str) -> tuple[int, ...]:
    in_f, out_f = shape.module_dims(name.split(".")[-3])
    return (spec.r, in_f) if ".lora_A." in name else (out_f, spec.r)


def test_heartbeats_go_on_while_a_large_adapter_is_validated(tmp_path: Path) -> None:
    """A ~190 MB adapter (r=256 on a 1024-wide, 8-layer model) is read, hashed and checked
    while heartbeats keep coming out on the diff socket: those announcing the head before
    the load (seq 1) go on after the load was sent, until it is committed."""
    shape = ModelShape(vocab_size=256, hidden_size=1024, intermediate_size=4096,
                       num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=16,
                       head_dim=64)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(model_config(shape)))
    h = shape.hidden_size

    def model_shape(name: str) -> tuple[int, ...]:
        module = name.split(".")[-2]
        if module in MODULE_PARENT:
            in_f, out_f = shape.module_dims(module)
            return (out_f, in_f)
        return (shape.vocab_size, h) if "embed" in name or "lm_head" in name else (h,)

    _sparse_safetensors(model / "model.safetensors",
                        {n: model_shape(n) for n in model_tensor_names(shape)})
    spec = AdapterSpec("big", r=256, lora_alpha=256, target_modules=tuple(MODULE_PARENT))
    adapter = tmp_path / "big"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps(
        adapter_config(spec, base_model_name_or_path="big")))

    _sparse_safetensors(adapter / WEIGHTS, {n: _lora_shape(shape, spec, n)
                                            for n in adapter_tensor_names(spec, shape)})
    assert (adapter / WEIGHTS).stat().st_size > 150 << 20
    svc = StateSvc(tmp_path / "data", extra_args=("--heartbeat-interval", "0.05")).start()
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"hb")
    sub.connect(svc.publish)
    try:
        with ControlClient(svc.control, timeout_s=120) as c:
            new_pool(c, model, max_rank=256)
            beats: list[dict[str, Any]] = []
            while not beats or beats[-1]["head_seq"] != 1:  # subscribed, and the pool is in
                assert sub.poll(10_000)
                beats.append(msgpack.unpackb(sub.recv_multipart()[1]))
            sent = time.time()
            assert load(c, "big", adapter)["seq"] == 2
            beats = []
            while not beats or beats[-1]["head_seq"] != 2:
                assert sub.poll(10_000)
                beats.append(msgpack.unpackb(sub.recv_multipart()[1]))
    finally:
        sub.close(0)
        svc.stop()
    during = [b for b in beats if b["head_seq"] == 1 and b["ts"] >= sent]
    # without heartbeats during the load, at most one (published just as it arrived) is here
    assert len(during) >= 3, f"{len(during)} heartbeats while the load was validated"


# ---- item 11: scaling the pool can hold; blob writes the disk refuses -------------------------


@pytest.mark.parametrize("dtype, alpha, rslora", [("float32", 1e300, False),
                                                  ("float32", 1e39, True),
                                                  ("bfloat16", 3.4e38 * 8, False)])
def test_lora_alpha_whose_scaling_overflows_the_pool_dtype_is_refused(
        tmp_path: Path, example: ExampleAssets, dtype: str, alpha: float, rslora: bool) -> None:
    svc = open_service(tmp_path / "data")
    try:
        init_pool(svc, example.model_dir, dtype=dtype)
        d = tmp_path / "alpha"
        shutil.copytree(example.adapter_dirs[QV], d)  # r=8
        cfg = json.loads((d / "adapter_config.json").read_text())
        (d / "adapter_config.json").write_text(json.dumps({**cfg, "lora_alpha": alpha,
                                                           "use_rslora": rslora}))
        err = refused(svc, d)
        assert err.code == "invalid_adapter"
        assert f"beyond the largest {dtype}" in str(err)
        assert "use a lora_alpha of at most" in str(err)
    finally:
        svc.store.close()


def _without_dac_override() -> tuple[str, ...]:
    """What runs statesvc so that file modes bind it: nothing for a plain user; for root,
    setpriv dropping the capabilities that let root ignore them."""
    if os.geteuid() != 0:
        return ()
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: file modes cannot refuse a write")
    return ("setpriv", "--bounding-set=-dac_override,-dac_read_search", "--")


@pytest.mark.parametrize("how", ["EACCES", "EFBIG"])
def test_blob_writes_the_disk_refuses_are_storage_errors(tmp_path: Path, example: ExampleAssets,
                                                         how: str) -> None:
    """The blob store's directory made read-only (EACCES), or a write cut short by the file
    size limit (EFBIG, RLIMIT_FSIZE: as a full disk cuts it): `storage_error` with the cause
    and the fix, no temporary file left, nothing recorded; statesvc serves on and the same
    load succeeds once the cause is gone."""
    data = tmp_path / "data"
    big = tmp_path / "big"  # 4 MiB: r=512 on every module of the example model
    spec = AdapterSpec("big", r=512, lora_alpha=512, target_modules=tuple(MODULE_PARENT))
    big.mkdir()
    (big / "adapter_config.json").write_text(json.dumps(
        adapter_config(spec, base_model_name_or_path="example")))
    _sparse_safetensors(big / WEIGHTS, {n: _lora_shape(example.shape, spec, n)
                                        for n in adapter_tensor_names(spec, example.shape)})
    if how == "EACCES":
        wrapper = _without_dac_override()
    else:  # a limit below this adapter's size but above what the log and the db write
        wrapper = ("prlimit", f"--fsize={(big / WEIGHTS).stat().st_size // 2}", "--")
        if shutil.which("prlimit") is None:
            pytest.skip("no prlimit")
    svc = StateSvc(data, wrapper=wrapper).start()
    tmp = data / "blobs" / "tmp"
    try:
        with ControlClient(svc.control) as c:
            new_pool(c, example.model_dir, max_rank=512)
            if how == "EACCES":
                tmp.chmod(0o500)
            with pytest.raises(RemoteError) as info:
                load(c, "x", big)
            err = info.value
            assert err.code == "storage_error", err
            cause = {"EACCES": "Permission denied [EACCES]", "EFBIG": "File too large [EFBIG]"}
            assert cause[how] in str(err) and "nothing was recorded" in str(err)
            assert ("writable by the user statesvc runs as" if how == "EACCES"
                    else "free space on the filesystem") in str(err)
            assert not list(tmp.iterdir()) and not list((data / "blobs").glob("??/*"))
            assert c.call("status")["head_seq"] == 1
            if how == "EACCES":
                tmp.chmod(0o755)
                assert load(c, "x", big)["seq"] == 2
    finally:
        tmp.chmod(0o755)
        svc.stop()
