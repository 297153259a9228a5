"""Fuzzing every decoder of outside input: no crash, no hang, no state change.

One section per decoding path:

- statesvc frames: `decode_request` on arbitrary, structured and mutated frames raises only
  ProtocolError, whose message names its field; what it lets in passes the schema again.
- statesvc commands: `StateService.handle` on well-formed requests carrying hostile values
  (paths to /proc/self/mem, /dev/zero, symlink loops, FIFOs, lying files; huge ints; unicode)
  answers each one, never with internal_error, and leaves the log, the state and the blob
  store as they were.
- replica frames: `Engine.submit` (the `generate` schema), `Daemon._serve_clients` in-process
  over a real ROUTER socket, then a real `statesvc serve` and `computed serve` fed random
  whole multipart messages (any number of envelope frames, empty or huge): every message gets
  one well-formed reply, nothing refused is echoed, and both keep answering and their state.
- safetensors: `parse_bytes` and `parse_header` raise only TensorFileError, what they accept
  is in range, consistent and agrees with the reference reader, and parsing allocates in
  proportion to the input, never to the sizes a header claims; `slot_weights` (the replica's
  reader of blobs) raises only BlobError.
- adapter directories: `inspect_adapter` on fuzzed adapter_config.json and
  adapter_model.safetensors raises only AdapterError.
- diffs: `body_of_diff` raises only EventError, and `apply` refuses what it returns cleanly.

`make test` runs a fixed number of examples per property, the same ones every time
(derandomized, no example database). LORAPLANE_FUZZ_EXAMPLES=N runs N fresh random examples
per property instead; docs/fuzzing.md has the long runs, atheris, and how to replay a failure.

Open bugs: every crashing or hanging input found is kept at the end of this file as an
xfail(strict=True) regression test, and KNOWN_BUGS lets the properties step over that bug
(counted as a Hypothesis event) so the suite stays green. When a fix lands its regression test
XPASSes, which fails the suite: delete its marker and its KNOWN_BUGS entry.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
import subprocess
import sys
import textwrap
import time
import tracemalloc
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from computed.daemon import Daemon
from computed.serving.engine import Engine
from computed.replica import Replica
from computed.residency.blob_cache import BlobError, slot_weights
from shared.client import ControlClient
from shared.config import (ADAPTER_NAME_RE, MAX_BLOB_CHUNK, MAX_EVENTS_PER_PAGE,
                           MAX_FRAME_BYTES, MAX_WIRE_BYTES)
from shared.events import AdapterLoaded, EventError, PoolConfigured
from shared.fingerprint import read_model
from shared.projections import MODULES
from shared.protocol import (COMMANDS, PUBLISHED_HEARTBEAT, WRITE_COMMANDS, ProtocolError, Request,
                             error_reply, ok_reply, pack, request_id_of, unpack, validate)
from shared.reducer import ReducerError, State, apply, body_of_diff, logical_digest
from shared.tensorfile import (DTYPE_SIZES, MAX_HEADER_BYTES, TensorFileError, parse_bytes,
                               parse_header, read_header)
from statesvc.adapters import AdapterError, inspect_adapter
from statesvc.service import Answer, StateService
from statesvc.tools.example import ExampleAssets
from testkit.fuzz_oracles import (HEARTBEAT, LOG_ID, REPLICA_SCHEMAS, TENSOR_BUGS,
                                  NoReplica, Refused, SchemaOnlyModel, check_adapter, check_diff,
                                  check_frame, check_heartbeat, check_submit, check_tensor_file,
                                  decode, diff_cases, example_pool, known_bug, names, note)
from testkit.inproc import call, init_pool, open_service
from tests.helpers import Fleet, dealer

REPO = Path(__file__).resolve().parents[2]
EXAMPLES_ENV = "LORAPLANE_FUZZ_EXAMPLES"


def budget(examples: int) -> settings:
    """Hypothesis settings for one property: `examples` fixed examples in `make test`, or
    LORAPLANE_FUZZ_EXAMPLES random ones (kept in .hypothesis/ when they fail)."""
    long_run = os.environ.get(EXAMPLES_ENV)
    extra: dict[str, Any] = {} if long_run else {"database": None}
    return settings(max_examples=int(long_run) if long_run else examples, deadline=None,
                    derandomize=not long_run, suppress_health_check=list(HealthCheck),
                    **extra)


# ---- open bugs ---------------------------------------------------------------------------


# ---- shared strategies -------------------------------------------------------------------

INT64 = st.integers(-(2**63), 2**64 - 1)
EDGE_INTS = st.sampled_from([0, 1, -1, 2, 16, 17, 64, 65, 255, 256, 1024, 1025, 4096, 4097,
                             MAX_EVENTS_PER_PAGE, MAX_EVENTS_PER_PAGE + 1, MAX_BLOB_CHUNK,
                             MAX_BLOB_CHUNK + 1, 2**31, 2**62, 2**62 + 1, 2**63 - 1, 2**64 - 1,
                             -(2**63)])
ODD_TEXT = st.sampled_from(["", ".", "..", "/", "a" * 64, "a" * 65, "a" * 257, "x" * 4097,
                            "\x00", "a\x00b", "\u202e", "\ud7ff", "\U0001f600", "CON", " ",
                            "all", "ALL", "q_proj", "none", "pending", "ACTIVE", "-a", "a/b"])
LEAVES = (st.none() | st.booleans() | INT64 | EDGE_INTS | st.floats() | st.text(max_size=24)
          | ODD_TEXT | st.binary(max_size=24))
# Values a msgpack frame can carry, including what the decoder must refuse: ext types,
# timestamps and non-string map keys.
WIRE = st.recursive(
    LEAVES | st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=8))
    | st.builds(msgpack.Timestamp, st.integers(0, 2**32 - 1), st.integers(0, 999_999_999)),
    lambda kids: (st.lists(kids, max_size=4)
                  | st.dictionaries(st.text(max_size=12) | ODD_TEXT, kids, max_size=4)
                  | st.dictionaries(st.integers(-5, 5) | st.binary(max_size=4), kids,
                                    max_size=2)),
    max_leaves=12)
# Values a JSON document can carry (Python's json also writes NaN and Infinity).
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | EDGE_INTS | st.floats()
    | st.text(max_size=16),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=10), kids,
                                                                max_size=3),
    max_leaves=8)


@st.composite
def mutated(draw: st.DrawFn, base: bytes, *, focus: int | None = None) -> bytes:
    """`base` with a few bytes flipped, set, cut, inserted or deleted (at first `focus` bytes
    half of the time)."""
    data = bytearray(base)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "cut", "insert", "delete"]))
        hi = len(data) if focus is None or draw(st.booleans()) else min(focus, len(data))
        i = draw(st.integers(0, max(0, hi - 1)))
        if op == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif not data:
            continue
        elif op == "flip":
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "set":
            data[i] = draw(st.sampled_from([0x00, 0x7F, 0x80, 0xC1, 0xFF, 0x22, 0x5B, 0x7B]))
        elif op == "cut":
            del data[i:]
        else:
            del data[i:i + draw(st.integers(1, 8))]
    return bytes(data)


# ---- statesvc: decode_request ------------------------------------------------------------


HEX64 = st.binary(min_size=32, max_size=32).map(bytes.hex)
NAMES = st.from_regex(ADAPTER_NAME_RE, fullmatch=True)
TOKENS = st.lists(st.integers(0, 255), min_size=1, max_size=8)
# A value each field of the statesvc and replica schemas takes.
VALID: dict[str, st.SearchStrategy[Any]] = {
    "event_id": st.uuids().map(str), "expect_head": st.none() | st.integers(0, 4),
    "model": st.sampled_from(["/nonexistent", "/proc", "/proc/self/mem"]),  # never a model
    "path": st.sampled_from(["/nonexistent", "/proc", "/dev/zero"]),  # never an adapter
    "max_loras": st.integers(1, 4096), "max_rank": st.integers(1, 1024),
    "targets": st.just("all") | st.lists(st.sampled_from(MODULES), min_size=1, unique=True),
    "dtype": st.sampled_from(["float32", "bfloat16"]), "name": NAMES, "pin": st.booleans(),
    "replace": st.booleans(), "force": st.booleans(), "since": st.integers(0, 2**62),
    "limit": st.integers(1, MAX_EVENTS_PER_PAGE), "seq": st.integers(0, 2**62),
    "sha256": HEX64, "offset": st.integers(0, 2**62), "length": st.integers(1, MAX_BLOB_CHUNK),
    "id": NAMES, "address": st.text(min_size=1, max_size=256),
    "state": st.sampled_from(["INITIAL", "SYNCING", "ACTIVE"]),
    "applied_seq": st.integers(0, 2**62), "logical_digest": HEX64,
    "pool_digest": HEX64 | st.sampled_from(["none", "pending"]),
    "slot": st.integers(0, 1 << 20), "adapter": st.none() | NAMES, "input_ids": TOKENS,
    "max_new_tokens": st.integers(1, 8), "temperature": st.floats(0, 100),
    "top_p": st.floats(0, 1, exclude_min=True), "seed": st.integers(0, 2**63 - 1),
    "stop_token_ids": st.lists(st.integers(0, 255), max_size=4), "min_seq": st.integers(0, 9),
}


def hostile_value(name: str) -> st.SearchStrategy[Any]:
    """Values near what the field `name` takes, and past its limits."""
    near: dict[str, st.SearchStrategy[Any]] = {
        "event_id": st.uuids().map(lambda u: str(u).upper()) | st.uuids().map(lambda u: u.hex),
        "sha256": st.text("0123456789abcdefABCDEF", min_size=63, max_size=65),
        "targets": st.lists(st.sampled_from(MODULES + ("lm_head", "")), max_size=9)
        | st.sampled_from(["ALL", "q_proj"]),
        "dtype": st.sampled_from(["float16", "int8", "FLOAT32"]),
        "state": st.sampled_from(["STALE", "active"]),
        "cmd": st.sampled_from(["drop_table", "", "LIST", "pool.init ", "generate\x00"]),
        "input_ids": st.lists(st.integers(-2, 300) | st.booleans() | st.floats(), max_size=70),
    }
    return near.get(name, st.nothing()) | EDGE_INTS | ODD_TEXT | LEAVES | WIRE


def field_value(name: str) -> st.SearchStrategy[Any]:
    """Mostly a value the field takes, sometimes a hostile one."""
    valid = VALID.get(name)
    if valid is None:
        return hostile_value(name)
    return st.integers(0, 3).flatmap(lambda i: hostile_value(name) if i == 0 else valid)


@st.composite
def request_maps(draw: st.DrawFn, commands: dict[str, Any]) -> dict[str, Any]:
    """A request envelope for one of `commands`, its fields mostly valid, some hostile,
    some missing, some unknown."""
    cmd = draw(st.sampled_from(sorted(commands)) if draw(st.integers(0, 7))
               else hostile_value("cmd"))
    fields = sorted(commands.get(cmd, {})) if isinstance(cmd, str) else []
    args = {f: draw(field_value(f)) for f in fields if draw(st.integers(0, 7))}
    if draw(st.integers(0, 7)) == 0:
        args[draw(st.text(min_size=1, max_size=8))] = draw(LEAVES)
    env: dict[str, Any] = {"v": 1, "id": draw(st.text(min_size=1, max_size=64)), "cmd": cmd,
                           "args": args}
    if draw(st.integers(0, 5)) == 0:
        key = draw(st.sampled_from(["v", "id", "cmd", "args", "extra"]))
        env[key] = draw(hostile_value(key))
    if draw(st.integers(0, 7)) == 0:
        del env[draw(st.sampled_from(sorted(env)))]
    return env


DEEP_FRAME = b"\x91" * 40_000 + b"\xc0"
HUGE_FRAME = pack(["x" * (MAX_FRAME_BYTES + 1)])


@st.composite
def frames(draw: st.DrawFn, commands: dict[str, Any]) -> bytes:
    """Frames: request maps (as they are, or with bytes mutated), any msgpack value, raw
    bytes, and now and then one nested 40 000 deep or over the size limit."""
    kind = draw(st.integers(0, 19))
    if kind < 10:
        return pack(draw(request_maps(commands)))
    if kind < 14:
        return draw(mutated(pack(draw(request_maps(commands)))))
    if kind < 16:
        return draw(st.binary(max_size=96))
    if kind < 19:
        return pack(draw(WIRE))
    return draw(st.sampled_from([DEEP_FRAME, HUGE_FRAME]))


@budget(400)
@given(frame=frames(COMMANDS))
def test_decode_request_raises_only_protocol_errors(frame: bytes) -> None:
    event(check_frame(frame))


# ---- statesvc: StateService.handle on hostile values -------------------------------------


@dataclass(frozen=True)
class OddPlaces:
    """Paths `load` must refuse, and paths `pool.init` must refuse on a fresh service."""

    adapters: tuple[str, ...]
    models: tuple[str, ...]


SYSTEM_PATHS = ("/", "/proc", "/proc/self", "/proc/self/mem", "/proc/self/pagemap",
                "/proc/self/fd", "/proc/self/fd/0", "/proc/self/cwd", "/proc/self/root/proc",
                "/dev", "/dev/zero", "/dev/null", "/dev/urandom", "/sys/kernel", "/etc/passwd",
                "//", "/./.", "/a/../../..", "/nonexistent/\u00e9\u2603", "/tmp/\U0001f600",
                "relative/dir", "./adapter", "..", "~", "/" + "a" * 300, "/" + "a/" * 2000)


def _write(path: Path, data: bytes | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


def _lying_safetensors(entry: dict[str, Any], *, data: bytes = b"\x00" * 16,
                       claimed: int | None = None) -> bytes:
    head = json.dumps({"t": entry}).encode()
    return struct.pack("<Q", len(head) if claimed is None else claimed) + head + data


def build_odd_places(root: Path, example: ExampleAssets) -> OddPlaces:
    """Adapter and model directories that lie, loop, point at devices or are broken."""
    good = example.adapter_dirs["all-r2"]
    cfg = json.loads((good / "adapter_config.json").read_text())
    weights = (good / "adapter_model.safetensors").read_bytes()
    adapters: dict[str, Path] = {}

    def adapter(name: str, config: bytes | str | None = None,
                tensors: bytes | None = None) -> Path:
        d = root / "adapters" / name
        d.mkdir(parents=True)
        if config is not None:
            _write(d / "adapter_config.json", config)
        if tensors is not None:
            _write(d / "adapter_model.safetensors", tensors)
        adapters[name] = d
        return d

    good_cfg = json.dumps(cfg)
    adapter("empty")
    adapter("cfg-dir").joinpath("adapter_config.json").mkdir()
    loop = adapter("cfg-loop", tensors=weights) / "adapter_config.json"
    loop.symlink_to(loop)
    adapter("cfg-dangling", tensors=weights).joinpath("adapter_config.json").symlink_to(
        root / "nowhere")
    for dev in ("zero", "null", "urandom"):
        adapter(f"cfg-dev-{dev}", tensors=weights).joinpath("adapter_config.json").symlink_to(
            f"/dev/{dev}")
        adapter(f"weights-dev-{dev}", good_cfg).joinpath(
            "adapter_model.safetensors").symlink_to(f"/dev/{dev}")
    for proc in ("mem", "pagemap", "maps", "environ"):  # regular files whose size says 0
        adapter(f"cfg-proc-{proc}", tensors=weights).joinpath(
            "adapter_config.json").symlink_to(f"/proc/self/{proc}")
        adapter(f"weights-proc-{proc}", good_cfg).joinpath(
            "adapter_model.safetensors").symlink_to(f"/proc/self/{proc}")
    os.mkfifo(adapter("cfg-fifo", tensors=weights) / "adapter_config.json")
    os.mkfifo(adapter("weights-fifo", good_cfg) / "adapter_model.safetensors")
    adapter("weights-dir", good_cfg).joinpath("adapter_model.safetensors").mkdir()
    adapter("cfg-empty", "", weights)
    adapter("cfg-null", "null", weights)
    adapter("cfg-latin1", b"\xff\xfe{}", weights)
    adapter("cfg-deep", "[" * 100_000, weights)
    adapter("cfg-r-digits", good_cfg.replace('"r": 2', '"r": ' + "1" * 5000), weights)
    adapter("cfg-alpha-huge", json.dumps({**cfg, "lora_alpha": 10**400}), weights)
    adapter("cfg-alpha-inf", json.dumps({**cfg, "lora_alpha": math.inf}), weights)
    adapter("cfg-r-bool", json.dumps({**cfg, "r": True}), weights)
    adapter("weights-empty", good_cfg, b"")
    adapter("weights-bin", good_cfg).joinpath("adapter_model.bin").write_bytes(b"\x80\x04K.")
    adapter("weights-header-2^63", good_cfg, struct.pack("<Q", 2**63) + weights[8:])
    adapter("weights-truncated", good_cfg, weights[: len(weights) // 2])
    adapter("weights-offsets-out", good_cfg, _lying_safetensors(
        {"dtype": "F32", "shape": [2**20, 2**20], "data_offsets": [0, 2**42]}))
    overlap = json.dumps({
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
            {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight":
            {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}).encode()
    adapter("weights-overlap", good_cfg, struct.pack("<Q", len(overlap)) + overlap + bytes(12))
    adapter("weights-count-mismatch", good_cfg, _lying_safetensors(
        {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}))
    for name, target in (("link-loop", None), ("link-proc-fd", "/proc/self/fd"),
                         ("link-dev", "/dev"), ("link-dangling", str(root / "nowhere"))):
        link = root / "adapters" / name
        link.symlink_to(link if target is None else target)
        adapters[name] = link

    models: dict[str, Path] = {}
    src = example.model_dir

    def model(name: str, *, drop: tuple[str, ...] = (), **files: bytes | str) -> Path:
        d = root / "models" / name
        shutil.copytree(src, d)
        for f in drop:
            (d / f).unlink()
        for f, data in files.items():
            _write(d / f.replace("__", "."), data)
        models[name] = d
        return d

    config = json.loads((src / "config.json").read_text())
    header = (src / "model.safetensors").read_bytes()
    model("no-config", drop=("config.json",))
    model("config-proc-mem", drop=("config.json",)).joinpath("config.json").symlink_to(
        "/proc/self/mem")
    model("config-dir", drop=("config.json",)).joinpath("config.json").mkdir()
    model("config-deep", config__json="[" * 100_000)
    model("config-not-llama", config__json=json.dumps({**config, "model_type": "gpt2"}))
    model("config-layers-3", config__json=json.dumps({**config, "num_hidden_layers": 3}))
    model("config-layers-huge", config__json=json.dumps({**config, "num_hidden_layers": 2**40}))
    model("config-big-int", config__json=json.dumps({**config, "extra": 2**70}))
    model("no-weights", drop=("model.safetensors",))
    model("bin-only", drop=("model.safetensors",), pytorch_model__bin=b"\x80\x04K.")
    model("weights-header-2^63", model__safetensors=struct.pack("<Q", 2**63) + header[8:])
    model("weights-header-100MB", model__safetensors=struct.pack("<Q", MAX_HEADER_BYTES)
          + header[8:])
    for dev in ("zero", "null"):
        model(f"weights-dev-{dev}", drop=("model.safetensors",)).joinpath(
            "model.safetensors").symlink_to(f"/dev/{dev}")
    index = "model.safetensors.index.json"
    for name, shards in (("index-escape", ["../model/model.safetensors"]),
                         ("index-dot", ["."]), ("index-self", [index]),
                         ("index-missing", ["nope.safetensors"]),
                         ("index-proc-mem", ["mem"]), ("index-hidden", [".x"]),
                         ("index-nested", [["a"]])):
        d = model(name, drop=("model.safetensors",),
                  **{index.replace(".", "__"): json.dumps({"weight_map": {
                      f"t{i}": s for i, s in enumerate(shards)}})})
        if name == "index-proc-mem":
            (d / "mem").symlink_to("/proc/self/mem")
    model("index-not-json", drop=("model.safetensors",),
          **{index.replace(".", "__"): "{"})
    model("index-no-map", drop=("model.safetensors",), **{index.replace(".", "__"): "[]"})
    paths = [str(p) for p in adapters.values()]
    return OddPlaces(adapters=tuple(paths) + SYSTEM_PATHS,
                     models=tuple(str(p) for p in models.values()) + tuple(paths) + SYSTEM_PATHS)


@pytest.fixture(scope="module")
def odd(tmp_path_factory: pytest.TempPathFactory, example: ExampleAssets) -> OddPlaces:
    return build_odd_places(tmp_path_factory.mktemp("odd"), example)


class Services(NamedTuple):
    fresh: StateService  # no pool: every pool.init here must fail
    ready: StateService  # a pool and one pinned adapter "a1"
    model: str
    sha256: str
    init_event_id: str


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory,
             example: ExampleAssets) -> Iterator[Services]:
    root = tmp_path_factory.mktemp("services")
    fresh, ready = open_service(root / "fresh"), open_service(root / "ready")
    init_pool(ready, example.model_dir)
    loaded = call(ready, "load", name="a1", path=str(example.adapter_dirs["all-r2"]), pin=True)
    assert loaded["created"]
    sha = ready.state.adapters["a1"].sha256
    init_id = ready.store.read(0, 1)[0].event_id
    try:
        yield Services(fresh, ready, str(example.model_dir), sha, init_id)
    finally:
        fresh.store.close()
        ready.store.close()


def _hostile_args(data: st.DataObject, cmd: str, svc: Services, odd: OddPlaces,
                  fresh: bool) -> dict[str, Any]:
    draw = data.draw

    def mostly(usual: st.SearchStrategy[Any], rare: st.SearchStrategy[Any]) -> Any:
        return draw(st.integers(0, 4).flatmap(lambda i: rare if i == 0 else usual))

    names = st.sampled_from(["a1", "A1", ".a", "a" * 64, "\u00fc", "a/b", "\u202e1a"]) \
        | st.text(min_size=1, max_size=64)
    ints = EDGE_INTS.filter(lambda i: 0 <= i <= 2**62) | st.integers(0, 2**62)
    event_id = mostly(st.uuids().map(str), st.just(svc.init_event_id))
    expect = mostly(st.none(), st.integers(0, 4) | ints)
    if cmd == "pool.init":
        models = odd.models if fresh else odd.models + (svc.model,)
        return {"event_id": event_id, "expect_head": expect,
                "model": draw(st.sampled_from(models) | st.text(min_size=1, max_size=64).map(
                    lambda s: "/" + s)),
                "max_loras": draw(st.integers(1, 4096) | st.just(4)),
                "max_rank": draw(st.integers(1, 1024) | st.just(16)),
                "targets": draw(st.just("all") | st.lists(st.sampled_from(MODULES), min_size=1,
                                                          max_size=7, unique=True)),
                "dtype": draw(st.sampled_from(["float32", "bfloat16"]))}
    if cmd == "load":
        return {"event_id": event_id, "expect_head": expect, "name": mostly(NAMES, names),
                "path": draw(st.sampled_from(odd.adapters) | st.text(min_size=1, max_size=64)),
                "pin": draw(st.booleans()), "replace": draw(st.booleans())}
    if cmd == "unload":
        name = mostly(NAMES, names)
        return {"event_id": event_id, "expect_head": expect, "name": name,
                "force": name != "a1" and draw(st.booleans())}  # unloading a1 is a real change
    if cmd == "events":
        return {"since": draw(ints), "limit": draw(st.integers(1, MAX_EVENTS_PER_PAGE))}
    if cmd == "digest":
        return {"seq": draw(st.integers(0, 3) | ints)}
    if cmd == "blob":
        return {"sha256": draw(st.just(svc.sha256) | st.binary(min_size=32, max_size=32).map(
            bytes.hex)), "offset": draw(st.integers(0, 300_000) | ints),
            "length": draw(st.integers(1, MAX_BLOB_CHUNK))}
    if cmd == "heartbeat":
        # a few valid addresses, so ids are registered, refreshed and refused moving
        address = mostly(st.sampled_from(["tcp://127.0.0.1:7200", "tcp://[::1]:7201",
                                          "ipc:///tmp/r1"]), st.text(min_size=1, max_size=256))
        return {"id": mostly(NAMES, names), "address": address,
                "state": draw(st.sampled_from(["INITIAL", "SYNCING", "ACTIVE"])),
                "applied_seq": draw(st.integers(0, 3) | ints),
                "logical_digest": draw(st.binary(min_size=32, max_size=32).map(bytes.hex)),
                "pool_digest": draw(st.sampled_from(["none", "pending", "0" * 64]))}
    return {}


def _fingerprint(svc: StateService) -> tuple[Any, ...]:
    """Everything a command must not change: the log, the state and the blob store."""
    return (svc.store.head(), [e.event_id for e in svc.store.read(0, MAX_EVENTS_PER_PAGE)],
            logical_digest(svc.state), svc.state.seq, sorted(svc.blobs.all()),
            sorted(p.name for p in svc.blobs.tmp.iterdir()))


def check_answer(ans: Answer, req: Request, known: tuple[str, ...]) -> None:
    """One result or one error, never internal_error (bar open bugs); the reply can be sent."""
    if ans.error is None:
        ok_reply(req.id, ans.result)
        return
    assert ans.result is None
    err = ans.error
    error_reply(req.id, err.code, str(err), err.field)
    if err.code == "internal_error":
        bug = known_bug(str(err), known)
        assert bug is not None, f"{req.cmd} {req.args}: {err}"
        note(f"known bug {bug}")
    if err.field is not None:
        assert err.field.startswith("args."), err.field


SERVICE_BUGS = ("adapter-oserror", "json-depth", "json-digits", "alpha-overflow")


@budget(120)
@given(data=st.data())
def test_service_answers_hostile_values_without_changing_anything(
        services: Services, odd: OddPlaces, data: st.DataObject) -> None:
    fresh = data.draw(st.booleans(), label="fresh")
    svc = services.fresh if fresh else services.ready
    cmds = data.draw(st.lists(st.sampled_from(sorted(COMMANDS)), min_size=1, max_size=4),
                     label="commands")
    batch = []
    for cmd in cmds:
        args = _hostile_args(data, cmd, services, odd, fresh)
        try:
            batch.append(Request(uuid.uuid4().hex, cmd, validate(COMMANDS[cmd], args, "args")))
        except ProtocolError:
            continue  # the decoder refuses it first (test_decode_request_... covers that)
    before = _fingerprint(svc)
    answers, committed = svc.handle([(req, "fuzz") for req in batch])
    assert committed == []
    assert len(answers) == len(batch)
    for req, ans in zip(batch, answers):
        check_answer(ans, req, SERVICE_BUGS)
        event(f"{req.cmd}: {ans.error.code if ans.error else 'ok'}")
        if req.cmd in WRITE_COMMANDS and ans.error is None:  # a no-op, or a retry answered
            assert not fresh and (ans.result.get("created") is False  # with the first result
                                  or req.args["event_id"] == services.init_event_id)
    assert _fingerprint(svc) == before
    assert svc.status()["head_seq"] == before[0]


# ---- replica: Engine.submit, and the ROUTER loop in-process ------------------------------


def generate_args() -> st.SearchStrategy[Any]:
    """`generate` args: near the schema (token lists at and past the limits) and hostile."""
    m = SchemaOnlyModel
    tokens = (st.lists(st.integers(0, m.vocab_size - 1), max_size=m.max_len + 2)
              | st.lists(st.integers(-2, m.vocab_size + 1) | st.booleans() | st.floats(),
                         max_size=4)
              | st.just(list(range(m.max_len))) | st.just([0] * 100_000))
    values: dict[str, st.SearchStrategy[Any]] = {
        "adapter": st.none() | st.text(max_size=65) | ODD_TEXT,
        "input_ids": tokens,
        "max_new_tokens": st.integers(-1, m.max_len + 1) | EDGE_INTS,
        "temperature": st.floats() | st.integers(-1, 101) | EDGE_INTS,
        "top_p": st.floats() | st.integers(-1, 2),
        "seed": st.integers(-1, 2**64) | EDGE_INTS,
        "stop_token_ids": tokens,
        "min_seq": st.integers(-1, 2**63) | EDGE_INTS,
    }

    @st.composite
    def near(draw: st.DrawFn) -> Any:
        if draw(st.integers(0, 9)) == 0:
            return draw(WIRE)
        args = {}
        for k, hostile in values.items():
            if k == "input_ids" or draw(st.booleans()):
                which = draw(st.integers(0, 4))  # mostly valid
                args[k] = draw(VALID[k] if which > 1 else hostile if which else LEAVES)
        if draw(st.integers(0, 7)) == 0:
            args[draw(st.text(max_size=8))] = draw(LEAVES)
        return args

    return near()


@budget(300)
@given(args=generate_args())
def test_engine_submit_validates_generate_args(args: Any) -> None:
    event(check_submit(args))


class LocalReplica(NamedTuple):
    daemon: Daemon
    client: zmq.Socket[Any]


@pytest.fixture(scope="module")
def local_replica(tmp_path_factory: pytest.TempPathFactory,
                  example: ExampleAssets) -> Iterator[LocalReplica]:
    """A Daemon with a real Replica (never synced) and the schema-only engine, in-process:
    the test pumps `_serve_clients` and `engine.step` as `serve_forever` does."""
    nowhere = "tcp://127.0.0.1:9"  # the sync thread is never started
    replica = Replica(read_model(example.model_dir),
                      ControlClient(nowhere, timeout_s=0.1, retries=0),
                      tmp_path_factory.mktemp("replica"))
    engine = Engine(SchemaOnlyModel(), replica, min_seq_wait_s=0.0)
    daemon = Daemon(replica, replica_id="fuzz", listen="tcp://127.0.0.1:0", state=nowhere,
                    diffs=nowhere, engine=engine, warmup=False, heartbeat=False)
    sock = dealer(daemon.listen)
    daemon.blob_server.start()
    try:
        yield LocalReplica(daemon, sock)
    finally:
        sock.close(0)
        daemon.blob_server.stop()
        daemon.router.close(0)


def check_reply(frame: bytes, sent: bytes, known: tuple[str, ...] = ()) -> dict[str, Any]:
    """A reply is a v1 map answering the request's id (or None), ok or a coded error."""
    reply = unpack(frame, max_bytes=MAX_WIRE_BYTES)
    assert isinstance(reply, dict) and reply["v"] == 1, reply
    try:
        want_id = request_id_of(unpack(sent))
    except ProtocolError:
        want_id = None
    assert reply["id"] in (want_id, None), (reply["id"], want_id)
    if not reply["ok"]:
        err = reply["error"]
        assert isinstance(err["code"], str) and isinstance(err["message"], str)
        if err["code"] == "internal_error":
            bug = known_bug(err["message"], known)
            assert bug is not None, err
            note(f"known bug {bug}")
    return reply


def _replica_view(status: dict[str, Any]) -> tuple[Any, ...]:
    return (status["state"], status["applied_seq"], status["logical_digest"],
            status["pool_digest"], status["slots"], status["inference"]["running"],
            status["inference"]["waiting"])


def _exchange(daemon: Daemon, sock: zmq.Socket[Any], frame: bytes) -> bytes:
    """Send one frame and pump the daemon as `serve_forever` does until the reply comes."""
    sock.send(frame)
    deadline = time.monotonic() + 30  # a guard against a hang, not a timing assertion
    while time.monotonic() < deadline:
        if daemon.router.poll(1):
            daemon._serve_clients()
        daemon._forward_blobs()  # `blob` chunks come back from the daemon's blob thread
        assert daemon.engine is not None
        if daemon.engine.busy:
            daemon._send(daemon.engine.step())
        daemon.replies.flush()
        if sock.poll(0):
            return sock.recv()
    raise AssertionError(f"no reply to {frame[:80]!r}")


@budget(100)
@given(batch=st.lists(frames(REPLICA_SCHEMAS), min_size=1, max_size=6))
def test_replica_loop_answers_every_frame(local_replica: LocalReplica,
                                          batch: list[bytes]) -> None:
    daemon, sock = local_replica
    before = _replica_view(daemon.status())
    for frame in batch:
        reply = check_reply(_exchange(daemon, sock, frame), frame)
        event(f"replica: {'ok' if reply['ok'] else reply['error']['code']}")
    assert not sock.poll(5)  # one reply per frame, nothing more
    assert _replica_view(daemon.status()) == before


# ---- the real services, fed random frames ------------------------------------------------


# Frames a peer may put before a request body. The services take one, REQ's empty delimiter,
# and refuse the rest without echoing them: empty, short, long and huge frames.
ENVELOPE_FRAMES = (st.just(b"") | st.binary(max_size=300)
                   | st.sampled_from([b"\x01" * (1 << 20), b"\x02" * (3 << 20)]))


@st.composite
def messages(draw: st.DrawFn, commands: dict[str, Any]) -> list[bytes]:
    """Whole multipart messages as a DEALER sends them: no envelope, REQ's delimiter, or any
    number of envelope frames of any size; then a request frame."""
    kind = draw(st.integers(0, 9))
    if kind < 3:
        prefix: list[bytes] = []
    elif kind < 5:
        prefix = [b""]
    elif kind < 9:
        prefix = draw(st.lists(ENVELOPE_FRAMES, min_size=1, max_size=6))
    else:
        prefix = [b""] * draw(st.integers(2, 200))
    return [*prefix, draw(frames(commands))]


def check_multipart_reply(parts: list[bytes], sent: list[bytes],
                          known: tuple[str, ...] = ()) -> dict[str, Any]:
    """A request without an envelope or after REQ's delimiter is answered after the same
    envelope; any other message gets one bad_frame error, and nothing it carried comes back."""
    if sent[:-1] in ([], [b""]):
        assert parts[:-1] == sent[:-1], [len(p) for p in parts]
        return check_reply(parts[-1], sent[-1], known)
    assert len(parts) == 1, f"{len(parts) - 1} frames echoed: {[len(p) for p in parts]}"
    reply = check_reply(parts[0], b"")
    assert reply["error"]["code"] == "bad_frame", reply
    return reply


def test_real_services_survive_random_messages(tmp_path: Path, example: ExampleAssets) -> None:
    """`statesvc serve` and `computed serve` (inference on, pool not configured, so a valid
    `generate` is refused at once with not_ready) answer every multipart message once, never
    echo what they refuse, and keep their state."""
    fleet = Fleet(tmp_path, example)
    fleet.statesvc.start()
    try:
        replica = fleet.replica("fuzz", args=("--no-warmup", "--min-seq-timeout", "0"))
        deadline = time.monotonic() + 60
        while replica.status()["state"] != "ACTIVE" and time.monotonic() < deadline:
            time.sleep(0.05)
        head, replica_before = fleet.head(), _replica_view(replica.status())
        assert replica_before[0] == "ACTIVE"
        ctx = zmq.Context.instance()
        socks = {}
        for name, address in (("statesvc", fleet.statesvc.control), ("computed", replica.listen)):
            socks[name] = ctx.socket(zmq.DEALER)
            socks[name].setsockopt(zmq.LINGER, 0)
            socks[name].connect(address)

        @budget(25)
        @given(to_statesvc=st.lists(messages(COMMANDS), max_size=4),
               to_computed=st.lists(messages(REPLICA_SCHEMAS), max_size=4))
        def feed(to_statesvc: list[list[bytes]], to_computed: list[list[bytes]]) -> None:
            for name, batch in (("statesvc", to_statesvc), ("computed", to_computed)):
                sock = socks[name]
                for message in batch:  # one at a time: replies to a batch may come out of order
                    sock.send_multipart(message)
                    assert sock.poll(20_000), f"{name} gave no reply to {len(message)} frames"
                    check_multipart_reply(sock.recv_multipart(), message, SERVICE_BUGS)

        try:
            feed()
        finally:
            for sock in socks.values():
                sock.close(0)
        assert fleet.statesvc.proc is not None and fleet.statesvc.proc.poll() is None
        assert replica.proc is not None and replica.proc.poll() is None
        assert fleet.head() == head
        assert _replica_view(replica.status()) == replica_before
    finally:
        fleet.stop()


# ---- safetensors: parse_bytes, parse_header, slot_weights --------------------------------

DTYPE_NAMES = sorted(DTYPE_SIZES)


@st.composite
def safetensors_files(draw: st.DrawFn, *, lies: bool = True) -> bytes:
    """A safetensors file that is honest, then perhaps (`lies`) lies: offsets out of range,
    overlapping tensors, shapes that disagree with byte counts, huge claimed shapes, absurd
    header sizes, wrong types and keys."""
    header: dict[str, Any] = {}
    offset = 0
    for i in range(draw(st.integers(0, 4))):
        dtype = draw(st.sampled_from(DTYPE_NAMES))
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        size = math.prod(shape) * DTYPE_SIZES[dtype]
        header[draw(st.text(max_size=12)) + str(i)] = {
            "dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    data_len = offset + (draw(st.integers(0, 8)) if lies else 0)
    for _ in range(draw(st.integers(0, 3)) if lies else 0):
        if not header:
            break
        entry = header[draw(st.sampled_from(sorted(header)))]
        lie = draw(st.sampled_from(["offsets", "overlap", "shape", "huge", "dtype", "types",
                                    "keys", "ndim"]))
        if lie == "offsets":
            entry["data_offsets"] = draw(st.lists(st.integers(-2, data_len + 2) | EDGE_INTS,
                                                  min_size=2, max_size=2))
        elif lie == "overlap":  # the same length, somewhere else
            span = entry.get("data_offsets")
            length = span[1] - span[0] if isinstance(span, list) and len(span) == 2 \
                and all(type(o) is int for o in span) else 4
            start = draw(st.integers(0, data_len))
            entry["data_offsets"] = [start, start + length]
        elif lie == "shape":
            entry["shape"] = draw(st.lists(st.integers(-1, 9), max_size=4))
        elif lie == "huge":
            entry["shape"] = draw(st.lists(st.integers(2**20, 2**41), min_size=1, max_size=4))
            dtype = entry.get("dtype")
            size = DTYPE_SIZES.get(dtype, 1) if isinstance(dtype, str) else 1
            entry["data_offsets"] = [0, math.prod(entry["shape"]) * size]
        elif lie == "dtype":
            entry["dtype"] = draw(st.sampled_from(["F4", "C64", "f32", "", "F8_E8M0"]) | JSON)
        elif lie == "types":
            entry[draw(st.sampled_from(["dtype", "shape", "data_offsets"]))] = draw(JSON)
        elif lie == "keys":
            if draw(st.booleans()):
                entry[draw(st.text(max_size=6))] = draw(JSON)
            else:
                del entry[draw(st.sampled_from(sorted(entry)))]
        else:
            entry["shape"] = [1] * draw(st.integers(5, 200))
    if draw(st.booleans()):
        metadata = st.dictionaries(st.text(max_size=6), st.text(max_size=6), max_size=3)
        header["__metadata__"] = draw(metadata | JSON if lies else metadata)
    if lies and draw(st.integers(0, 7)) == 0:
        header = draw(JSON)  # not even a map
    head = json.dumps(header).encode()
    head += b" " * draw(st.integers(0, 7))
    n = len(head)
    if lies and draw(st.integers(0, 5)) == 0:
        n = draw(st.sampled_from([0, 1, n - 1, n + 1, MAX_HEADER_BYTES, MAX_HEADER_BYTES + 1,
                                  2**32, 2**63, 2**64 - 1]) | st.integers(0, 2**64 - 1))
    return struct.pack("<Q", max(0, n)) + head + draw(st.binary(min_size=data_len,
                                                                max_size=data_len))


TENSOR_INPUTS = (safetensors_files() | safetensors_files().flatmap(lambda b: mutated(b, focus=96))
                 | st.binary(max_size=64))


@budget(400)
@given(buf=TENSOR_INPUTS)
def test_parse_bytes_raises_only_tensor_file_errors(buf: bytes) -> None:
    event(check_tensor_file(buf))


@budget(100)
@given(buf=safetensors_files(lies=False))
def test_parse_bytes_accepts_what_the_reference_reader_accepts(buf: bytes) -> None:
    event(check_tensor_file(buf))


@budget(100)
@given(buf=safetensors_files(), claimed=st.integers(0, 2**40))
def test_parse_header_allocates_for_the_input_not_for_the_claims(buf: bytes,
                                                                 claimed: int) -> None:
    """A header claiming huge shapes, offsets or file sizes costs memory in proportion to its
    own bytes: a parser that allocated for a claim would take GiBs here."""
    tracemalloc.start()
    try:
        decode(lambda: parse_header(buf, len(buf) + claimed), TensorFileError,
               known=TENSOR_BUGS)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= (1 << 20) + 64 * len(buf), peak


def _adapter_loaded(rank: int = 2) -> AdapterLoaded:
    return AdapterLoaded("a", 2, "0" * 64, 0, rank, 8.0, 4.0, False, MODULES, False)


@pytest.fixture(scope="module")
def adapter_bytes(example: ExampleAssets) -> bytes:
    return (example.adapter_dirs["all-r2"] / "adapter_model.safetensors").read_bytes()


@budget(150)
@given(data=st.data())
def test_slot_weights_raises_only_blob_errors(adapter_bytes: bytes, data: st.DataObject) -> None:
    buf = data.draw(mutated(adapter_bytes, focus=200) | TENSOR_INPUTS)
    got = decode(lambda: slot_weights(buf, _adapter_loaded()), BlobError, known=TENSOR_BUGS)
    event("refused" if isinstance(got, Refused) else "accepted")


# ---- adapter directories: inspect_adapter ------------------------------------------------

CONFIG_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "r": st.sampled_from([0, 1, 2, 3, 16, 17, -1, 2**31, 2**63, 10**300, True, 2.0, "2"]),
    "lora_alpha": st.sampled_from([0, -1, 8, 1e-300, 1e308, math.inf, math.nan, 10**300,
                                   10**309, True, "8"]) | st.floats(),
    "use_rslora": st.sampled_from([True, False, "false", 0, None, [], {}]),
    "target_modules": st.lists(st.sampled_from(MODULES + (
        "lm_head", "embed_tokens", "self_attn.q_proj", "mlp", "model.layers.1.mlp.down_proj",
        "base_model.model.model.layers.0.self_attn.q_proj")), max_size=8)
    | st.sampled_from(["all-linear", "ALL-LINEAR", ".*proj", "(", "(a+)+b", ""]) | JSON,
    "exclude_modules": st.lists(st.sampled_from(MODULES + ("self_attn.q_proj", "[")))
    | st.sampled_from([r".*\.0\..*", "(", ""]) | JSON,
    "layers_to_transform": st.sampled_from([0, 1, 7, [0], [1, 5], [], "0", None, True]) | JSON,
    "layers_pattern": st.sampled_from(["layers", "h", ["layers"], "(", None]) | JSON,
    "init_lora_weights": st.sampled_from([True, False, "pissa", "pissa_niter_4", "olora",
                                          "gaussian", "mica", "loftq", "orthogonal", "x"]) | JSON,
    "peft_type": st.sampled_from(["LORA", "lora", "LOHA", None]),
    "use_dora": st.booleans(), "modules_to_save": JSON, "rank_pattern": JSON,
    "alpha_pattern": JSON, "bias": st.sampled_from(["none", "all", "lora_only"]) | JSON,
    "lora_bias": JSON, "fan_in_fan_out": JSON, "layer_replication": JSON,
    "trainable_token_indices": JSON,
}


@st.composite
def adapter_configs(draw: st.DrawFn, base: dict[str, Any]) -> bytes:
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=64) | JSON.map(lambda v: json.dumps(v).encode()))
    cfg = dict(base)
    for key in draw(st.lists(st.sampled_from(sorted(CONFIG_VALUES)), max_size=3)):
        if draw(st.integers(0, 4)) == 0:
            cfg.pop(key, None)
        else:
            cfg[key] = draw(CONFIG_VALUES[key] | JSON if draw(st.integers(0, 4)) == 0
                            else CONFIG_VALUES[key])
    return json.dumps(cfg).encode()


@st.composite
def adapter_weights(draw: st.DrawFn, base: bytes) -> bytes:
    """The example adapter's weights: as they are, with bytes mutated, with one header entry
    changed, with NaN written into a tensor, or another file altogether."""
    how = draw(st.sampled_from(["same", "bytes", "entry", "nan", "other"]))
    if how == "same":
        return base
    if how == "bytes":
        return draw(mutated(base, focus=200))
    if how == "other":
        return draw(TENSOR_INPUTS)
    n = struct.unpack("<Q", base[:8])[0]
    header = json.loads(base[8:8 + n])
    names = sorted(k for k in header if k != "__metadata__")
    name = draw(st.sampled_from(names))
    if how == "nan":
        start = 8 + n + header[name]["data_offsets"][0]
        return base[:start] + struct.pack("<f", math.nan) + base[start + 4:]
    entry = header.pop(name)
    change = draw(st.sampled_from(["rename", "dtype", "shape", "drop", "swap"]))
    if change == "rename":
        header[draw(st.sampled_from([
            name.replace("layers.0", "layers.7"), name.replace("lora_A", "lora_C"),
            name.replace("self_attn", "mlp"), name.replace(".weight", ".bias"),
            "base_model.model.model.embed_tokens.weight", "base_model.model.lm_head.weight",
            name.replace("layers.0", "layers.00"), name + "\x00"]) | st.text(max_size=40))] = entry
    elif change == "dtype":
        header[name] = {**entry, "dtype": draw(st.sampled_from(["F16", "BF16", "F64", "I32",
                                                                "U8", "BOOL"]))}
    elif change == "shape":
        header[name] = {**entry, "shape": list(reversed(entry["shape"]))}
    elif change == "swap":
        other = draw(st.sampled_from(names))
        header[name] = {**entry, "data_offsets": header.get(other, entry)["data_offsets"]}
    head = json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head + base[8 + n:]


@pytest.fixture(scope="module")
def pool(example: ExampleAssets) -> PoolConfigured:
    return example_pool(example.model_dir)


@budget(200)
@given(data=st.data())
def test_inspect_adapter_raises_only_adapter_errors(
        tmp_path_factory: pytest.TempPathFactory, example: ExampleAssets,
        pool: PoolConfigured, data: st.DataObject) -> None:
    good = example.adapter_dirs[data.draw(st.sampled_from(sorted(example.adapter_dirs)))]
    base_cfg = json.loads((good / "adapter_config.json").read_text())
    cfg = data.draw(adapter_configs(base_cfg), label="adapter_config.json")
    weights = data.draw(adapter_weights((good / "adapter_model.safetensors").read_bytes()),
                        label="adapter_model.safetensors")
    d = tmp_path_factory.mktemp("adapter", numbered=True)
    _write(d / "adapter_config.json", cfg)
    _write(d / "adapter_model.safetensors", weights)
    try:
        event(check_adapter(d, pool))
    finally:
        shutil.rmtree(d)


# ---- diffs: body_of_diff -----------------------------------------------------------------


@pytest.fixture(scope="module")
def diffs(pool: PoolConfigured) -> tuple[State, list[dict[str, Any]]]:
    return diff_cases(pool)


@st.composite
def mutated_diffs(draw: st.DrawFn, bases: list[dict[str, Any]]) -> Any:
    if draw(st.integers(0, 9)) == 0:
        return draw(WIRE)
    diff = json.loads(json.dumps(draw(st.sampled_from(bases))))
    for _ in range(draw(st.integers(1, 3))):
        inner = diff.get("pool")
        target = inner if isinstance(inner, dict) and draw(st.booleans()) else diff
        key = draw(st.sampled_from(sorted(target)) | st.text(max_size=8))
        if draw(st.integers(0, 4)) == 0:
            target.pop(key, None)
        else:
            target[key] = draw(st.sampled_from([math.inf, -math.inf, math.nan, 10**400, -1,
                                                2**64, True, "1", [1, 2], {"a": 1}])
                               | LEAVES | JSON)
    return diff


@budget(300)
@given(data=st.data())
def test_body_of_diff_raises_only_event_errors(diffs: tuple[State, list[dict[str, Any]]],
                                               data: st.DataObject) -> None:
    state, bases = diffs
    event(check_diff(data.draw(mutated_diffs(bases), label="diff"), state))


# ---- the diff stream's heartbeats: PUBLISHED_HEARTBEAT ------------------------------------


@st.composite
def mutated_heartbeats(draw: st.DrawFn) -> Any:
    if draw(st.integers(0, 9)) == 0:
        return draw(WIRE)
    hb: dict[str, Any] = dict(HEARTBEAT)
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(sorted(hb)) | st.text(max_size=8))
        if draw(st.integers(0, 4)) == 0:
            hb.pop(key, None)
        else:
            hb[key] = draw(st.sampled_from([math.inf, -math.inf, math.nan, 10**400, -1, 2**62 + 1,
                                            True, "1", LOG_ID.upper(), LOG_ID + "0", [1]])
                           | LEAVES)
    return hb


@budget(300)
@given(hb=mutated_heartbeats())
def test_published_heartbeat_schema_raises_only_protocol_errors(hb: Any) -> None:
    event(check_heartbeat(hb))


# ---- regression tests: inputs the fuzzers found ------------------------------------------
# Each is a bug still open when written; the reason names the fix. When one XPASSes, remove
# its marker and its KNOWN_BUGS entry.


def _json_header(body: bytes) -> bytes:
    return struct.pack("<Q", len(body)) + body


def test_regression_header_nested_100000_deep() -> None:
    with pytest.raises(TensorFileError):
        parse_bytes(_json_header(b"[" * 100_000 + b"]" * 100_000))


def test_regression_header_integer_of_5000_digits() -> None:
    with pytest.raises(TensorFileError):
        parse_bytes(_json_header(b'{"a":' + b"1" * 5000 + b"}"))


def test_regression_header_shape_with_1000_dims() -> None:
    head = json.dumps({"t": {"dtype": "U8", "shape": [2**40 - 1] * 1000,
                             "data_offsets": [0, 0]}}).encode()
    with pytest.raises(TensorFileError):
        parse_bytes(_json_header(head))


def test_regression_read_header_of_a_tiny_file_claiming_100_mib(tmp_path: Path) -> None:
    path = _write(tmp_path / "x.safetensors", struct.pack("<Q", MAX_HEADER_BYTES) + b"{}")
    tracemalloc.start()
    try:
        with pytest.raises(TensorFileError):
            read_header(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak} bytes allocated to refuse a 10-byte file"


def _adapter_dir(tmp_path: Path, example: ExampleAssets, **config: Any) -> Path:
    good = example.adapter_dirs["all-r2"]
    d = tmp_path / "adapter"
    shutil.copytree(good, d)
    cfg = json.loads((good / "adapter_config.json").read_text())
    (d / "adapter_config.json").write_text(json.dumps({**cfg, **config}))
    return d


def test_regression_lora_alpha_10_to_the_400(tmp_path: Path, example: ExampleAssets,
                                             pool: PoolConfigured) -> None:
    with pytest.raises(AdapterError, match="lora_alpha"):
        inspect_adapter(_adapter_dir(tmp_path, example, lora_alpha=10**400), pool)


def test_regression_adapter_config_nested_100000_deep(tmp_path: Path, example: ExampleAssets,
                                                      pool: PoolConfigured) -> None:
    d = _adapter_dir(tmp_path, example)
    (d / "adapter_config.json").write_text("[" * 100_000)
    with pytest.raises(AdapterError, match="not valid JSON"):
        inspect_adapter(d, pool)


@pytest.mark.parametrize("name, target", [("adapter_config.json", "/proc/self/mem"),
                                          ("adapter_model.safetensors", "/proc/self/pagemap")])
def test_regression_adapter_file_is_a_proc_file(tmp_path: Path, example: ExampleAssets,
                                                pool: PoolConfigured, name: str, target: str) -> None:
    d = _adapter_dir(tmp_path, example)
    (d / name).unlink()
    (d / name).symlink_to(target)
    with pytest.raises(AdapterError, match=re.escape(name)):
        inspect_adapter(d, pool)


def test_regression_load_path_with_a_300_byte_component(tmp_path: Path,
                                                        example: ExampleAssets) -> None:
    svc = open_service(tmp_path / "data")
    try:
        init_pool(svc, example.model_dir)
        head = svc.store.head()
        [answer], _ = svc.handle([(Request("r", "load", validate(COMMANDS["load"], {
            "event_id": str(uuid.uuid4()), "name": "x", "path": "/" + "a" * 300}, "args")),
            "t")])
        assert svc.store.head() == head
        assert answer.error is not None and answer.error.code == "invalid_adapter", answer.error
    finally:
        svc.store.close()


# read_model(argv[1]) in a child Python whose address space may grow 256 MiB past its imports
READ_MODEL_IN_A_CHILD = textwrap.dedent("""\
    import resource, sys
    from shared.fingerprint import ModelError, read_model
    vm = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status")
              if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + (256 << 20),) * 2)
    try:
        read_model(sys.argv[1])
        print("accepted")
    except ModelError as exc:
        print("refused:", exc)
    """)


def read_model_isolated(*model_dirs: Path, timeout_s: float) -> list[str]:
    """What read_model says of each directory, each in its own child process, all at once;
    "hung" for a child still running after `timeout_s` (then killed)."""
    children = [subprocess.Popen([sys.executable, "-c", READ_MODEL_IN_A_CHILD, str(d)],
                                 cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
                for d in model_dirs]
    deadline = time.monotonic() + timeout_s
    out = []
    for child in children:
        try:
            out.append(child.communicate(timeout=max(0.1, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            child.kill()
            child.communicate()
            out.append(f"hung: no answer within {timeout_s:g} s")
    return out


def _model_copy(tmp_path: Path, example: ExampleAssets, name: str) -> Path:
    d = tmp_path / name
    shutil.copytree(example.model_dir, d)
    return d


def test_regression_model_config_is_dev_zero(tmp_path: Path, example: ExampleAssets) -> None:
    d = _model_copy(tmp_path, example, "model")
    (d / "config.json").unlink()
    (d / "config.json").symlink_to("/dev/zero")
    [out] = read_model_isolated(d, timeout_s=30)
    assert out.startswith("refused:"), out


def test_regression_model_files_that_are_fifos(tmp_path: Path, example: ExampleAssets) -> None:
    config = _model_copy(tmp_path, example, "config")
    (config / "config.json").unlink()
    os.mkfifo(config / "config.json")
    shard = _model_copy(tmp_path, example, "shard")
    (shard / "model.safetensors").unlink()
    (shard / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "shard.safetensors"}}))
    os.mkfifo(shard / "shard.safetensors")
    outs = read_model_isolated(config, shard, timeout_s=5)
    assert all(out.startswith("refused:") for out in outs), outs


def test_regression_diff_with_infinite_seq(diffs: tuple[State, list[dict[str, Any]]]) -> None:
    with pytest.raises(EventError):
        body_of_diff({**diffs[1][2], "seq": math.inf})


def test_regression_diff_with_an_int_name(diffs: tuple[State, list[dict[str, Any]]]) -> None:
    state, bases = diffs
    diff = {**bases[1], "name": 5}
    try:
        seq, body = body_of_diff(diff)
    except EventError:
        return
    with pytest.raises((ReducerError, EventError)):
        apply(state, seq, body)


def test_regression_generate_args_with_int_and_bytes_keys() -> None:
    engine = Engine(SchemaOnlyModel(), NoReplica())
    done = engine.submit("req", {0: None, b"": None}, [b"client"])
    assert done is not None and done.error is not None and done.error.code == "bad_request"


def test_regression_heartbeat_ts_beyond_a_float() -> None:
    # found by benchmarks/fuzz_long: float() of a 401-digit int raised OverflowError out of
    # validate (msgpack cannot carry such an int; JSON and in-process callers can)
    with pytest.raises(ProtocolError, match=r"hb\.ts is beyond a float's range"):
        validate(PUBLISHED_HEARTBEAT, {**HEARTBEAT, "ts": 10**400}, "hb")
    assert validate(PUBLISHED_HEARTBEAT, {**HEARTBEAT, "ts": 2**64}, "hb")["ts"] == 2.0**64


def test_regression_tensor_entry_with_an_extra_key() -> None:
    # found by benchmarks/fuzz_long (seed 270776134): the safetensors library ignores keys
    # of a tensor entry beyond dtype, shape and data_offsets; the parser refused them
    head = json.dumps({"a": {"dtype": "BF16", "shape": [], "data_offsets": [0, 2], "": None},
                       "b": {"dtype": "BF16", "shape": [], "data_offsets": [2, 4]}}).encode()
    header = parse_bytes(_json_header(head) + bytes(4))
    assert sorted(header.tensors) == ["a", "b"]
    with pytest.raises(TensorFileError, match="must have dtype, shape and data_offsets"):
        parse_bytes(_json_header(json.dumps({"a": {"dtype": "BF16", "shape": []}}).encode()))
