"""The fuzz oracles: for each decoder of outside input, a function of one input that checks
what the decoder did with it (refused it with its own error, or accepted something that keeps
its promises). tests/property/test_fuzz.py runs them under Hypothesis and
benchmarks/fuzz_long.py under Hypothesis or atheris; open bugs are stepped over only when
STEP_OVER_KNOWN_BUGS is set."""
from __future__ import annotations

import hashlib
import json
import math
import re
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple

import safetensors
from hypothesis import event
from hypothesis.errors import InvalidArgument

from computed.serving.admission import AdmittedAdapter
from computed.serving.engine import Engine
from computed.residency.pool import LoraPool
from shared.config import UUID_RE
from shared.events import AdapterLoaded, AdapterUnloaded, EventError, PoolConfigured
from shared.fingerprint import read_model
from shared.projections import MODULES
from shared.protocol import (COMMANDS, PUBLISHED_HEARTBEAT, ProtocolError, Request,
                             decode_request, error_reply, validate)
from shared.reducer import ReducerError, State, apply, body_of_diff, diff_of
from shared.replica_protocol import BLOB_ARGS, CANCEL_ARGS, SLOT_ARGS
from shared.tensorfile import DTYPE_SIZES, Header, TensorFileError, parse_bytes
from statesvc.adapters import AdapterError, inspect_adapter


LOG_ID = "0b7e4f9e-3c1a-4f7e-9a52-1f0c2d3e4b5a"  # the identity of the log the diffs come from


@dataclass(frozen=True)
class Bug:
    """An open bug: the exception it raises and a pattern of its message."""

    kind: type[BaseException]
    says: str

    def matches(self, text: str) -> bool:
        """`text` is "Kind: message", as an exception or an internal_error answer shows it."""
        return re.search(rf"\b{self.kind.__name__}: .*?{self.says}", text, re.S) is not None


# Open bugs that raise. Those that hang or allocate instead (read-header-alloc, unbounded-read,
# fifo-hang) cannot be stepped over: the strategies leave their inputs out (no FIFO or
# /dev/zero config.json in build_odd_places) and only their regression tests run them.
KNOWN_BUGS: dict[str, Bug] = {
    # deep JSON in a header or config: json.loads raises RecursionError
    "json-depth": Bug(RecursionError, r"maximum recursion depth exceeded while decoding"),
    # a JSON integer of over 4300 digits: json.loads raises a plain ValueError
    "json-digits": Bug(ValueError, r"integer string conversion: value has \d+ digits"),
    # a tensor with many dimensions: math.prod takes quadratic time, then its message
    # cannot format the product
    "shape-product": Bug(ValueError, r"integer string conversion; use"),
    # lora_alpha beyond float range: math.isfinite raises OverflowError
    "alpha-overflow": Bug(OverflowError, r"int too large to convert to float"),
    # inspect_adapter lets OSError out: EIO (/proc/self/mem), EINVAL (/proc/self/pagemap),
    # ENAMETOOLONG (a path component over 255 bytes)
    "adapter-oserror": Bug(OSError, r"\[Errno (5|22|36)\]"),
    # body_of_diff lets OverflowError out (inf where an int goes, a huge int where a float goes)
    "diff-overflow": Bug(OverflowError, r"(cannot convert float infinity|too large to convert)"),
    # validate() sorts unknown keys: a map with keys of mixed types (int and bytes) raises
    # TypeError (the wire cannot carry one: unpack refuses non-string keys first)
    "validate-keys": Bug(TypeError, r"not supported between instances of"),
    # body_of_diff checks no field types, so apply() fails on what it returns
    "diff-types": Bug(TypeError, r""),
}


class Refused(NamedTuple):
    error: BaseException


# False makes every open bug fail again (benchmarks/fuzz_long.py --strict).
STEP_OVER_KNOWN_BUGS = False  # every bug below is fixed; a property that trips one fails


def known_bug(text: str, allowed: tuple[str, ...]) -> str | None:
    if not STEP_OVER_KNOWN_BUGS:
        return None
    return next((b for b in allowed if KNOWN_BUGS[b].matches(text)), None)


def note(what: str) -> None:
    """A Hypothesis event inside a property (see --hypothesis-show-statistics); nothing when
    an oracle runs under atheris."""
    try:
        event(what)
    except InvalidArgument:
        pass


def decode(fn: Callable[[], Any], refuses: type[BaseException] | tuple[type[BaseException], ...],
           *, known: tuple[str, ...] = ()) -> Any:
    """fn()'s value; Refused(error) when it raised one of `refuses`; None when it hit one of
    the open bugs `known`. Anything else propagates and fails the property."""
    try:
        return fn()
    except refuses as exc:
        return Refused(exc)
    except Exception as exc:
        bug = known_bug(f"{type(exc).__name__}: {exc}", known)
        if bug is None:
            raise
        note(f"known bug {bug}")
        return None


ERROR_CODES = {"too_large", "bad_frame", "bad_request", "unknown_command"}


def names(field: str, message: str) -> bool:
    """The message names the field's last part, as it is or as repr() escapes it."""
    last = field.rsplit(".", 1)[-1]
    return last in message or repr(last)[1:-1] in message


def check_refusal(err: ProtocolError) -> None:
    """The error has a known code, and its field is one the message names."""
    assert err.code in ERROR_CODES, err.code
    if err.field is not None:
        assert err.field.split(".")[0] in ("request", "args"), err.field
    if err.field is not None and err.code != "unknown_command":  # that one says "command"
        assert names(err.field, str(err)), (err.field, str(err))
    error_reply(None, err.code, str(err), err.field)  # the reply can be sent


def check_frame(frame: bytes) -> str:
    """The oracle for decode_request: a ProtocolError naming its field, or a request whose
    args pass the schema again."""
    got = decode(lambda: decode_request(frame), ProtocolError)
    if isinstance(got, Refused):
        assert isinstance(got.error, ProtocolError)
        check_refusal(got.error)
        return f"refused: {got.error.code}"
    req: Request = got
    schema = COMMANDS[req.cmd]
    assert set(req.args) == set(schema)
    assert validate(schema, req.args, "args") == req.args  # what was let in passes again
    assert 0 < len(req.id) <= 64
    return f"accepted: {req.cmd}"


class SchemaOnlyModel:
    """The engine's `Model` for schema fuzzing: it must never be run."""

    vocab_size, max_len, max_batch = 256, 64, 2

    def bucket(self, length: int) -> int:
        return self.max_len

    def new_cache(self) -> Any:
        return None

    def prefill(self, *_: Any, **__: Any) -> Any:
        raise AssertionError("a fuzzed request reached the model")

    decode = warmup = copy_row = prefill


class NoReplica:
    """The admission port of an engine that only validates: a fuzzed request is queued, and
    must never get further (the oracles check what was queued, not what ran)."""

    def want(self, adapter: str | None) -> None:
        pass

    def admit(self, adapter: str | None, min_seq: int, ticket: int = 0) -> AdmittedAdapter:
        raise AssertionError("a fuzzed request reached admission")

    def withdraw(self, ticket: int) -> None:
        pass

    def reading(self) -> AbstractContextManager[LoraPool]:
        raise AssertionError("a fuzzed request reached the pool")

    def pool_shapes(self) -> LoraPool | None:
        return None


# The replica's commands and their fields, for request_maps.
REPLICA_SCHEMAS: dict[str, Any] = {
    "status": {}, "slot": SLOT_ARGS, "cancel": CANCEL_ARGS, "blob": BLOB_ARGS,
    "generate": Engine(SchemaOnlyModel(), NoReplica()).schema}


REPLICA_FIELDS = {f"args.{k}" for k in REPLICA_SCHEMAS["generate"]}


def check_queued(engine: Engine, args: dict[str, Any]) -> None:
    """What the engine queued passes its schema again, with the types and ranges it promises."""
    m = engine.model
    assert validate(engine.schema, args, "args") == args
    ids = args["input_ids"]
    assert 1 <= len(ids) and len(ids) + args["max_new_tokens"] <= m.max_len
    assert all(type(t) is int and 0 <= t < m.vocab_size for t in ids + args["stop_token_ids"])
    assert type(args["temperature"]) is float and 0.0 <= args["temperature"] <= 100.0
    assert type(args["top_p"]) is float and 0.0 < args["top_p"] <= 1.0
    assert type(args["seed"]) is int and 0 <= args["seed"] < 2**63
    assert args["adapter"] is None or 1 <= len(args["adapter"]) <= 64


def check_submit(args: Any) -> str:
    """The oracle for Engine.submit: a coded error naming its field with nothing queued, or
    one request queued whose args keep the schema's promises."""
    engine = Engine(SchemaOnlyModel(), NoReplica())
    queued = object()
    done = decode(lambda: engine.submit("req", args, [b"client"]) or queued, (),
                  known=("validate-keys",))
    if done is None:
        return "known bug"
    if done is queued:
        assert len(engine.waiting) == 1
        check_queued(engine, engine.waiting[0].args)
        return "queued"
    assert not engine.waiting and not engine.busy  # refused: nothing queued
    err = done.error
    assert err is not None and done.result is None
    assert err.code in {"bad_request", "prompt_too_long"}, err.code
    if err.field is not None:
        assert err.field.split(".")[0] == "args", err.field
        if err.code != "prompt_too_long":  # that one says "prompt tokens"
            assert names(err.field, str(err)), err
    error_reply(done.req_id, err.code, str(err), err.field)
    return f"refused: {err.code} {err.field if err.field in REPLICA_FIELDS else ''}"


def check_header(header: Header, total: int) -> None:
    """What the parser accepted is what it promises: in range, exact sizes, no overlap."""
    data_len = total - header.data_start
    assert 8 <= header.data_start <= total
    spans = []
    for t in header.tensors.values():
        assert t.dtype in DTYPE_SIZES and all(type(d) is int and d >= 0 for d in t.shape)
        assert 0 <= t.start <= t.end <= data_len
        assert t.end - t.start == math.prod(t.shape) * DTYPE_SIZES[t.dtype]
        if t.end > t.start:
            spans.append((t.start, t.end))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in header.metadata.items())


TENSOR_BUGS = ("json-depth", "json-digits", "shape-product")


def check_tensor_file(buf: bytes) -> str:
    """The oracle for parse_bytes: a TensorFileError, or a header that keeps its promises;
    and a file the reference reader (safetensors) accepts, with dtypes this one knows, this
    one accepts with the same tensors."""
    got = decode(lambda: parse_bytes(buf), TensorFileError, known=TENSOR_BUGS)
    try:
        reference = {n: (t["dtype"], list(t["shape"])) for n, t in
                     safetensors.deserialize(buf)}  # type: ignore[no-untyped-call]
    except Exception:
        reference = None
    if reference is not None and not all(d in DTYPE_SIZES and len(shape) <= 4
                                         for d, shape in reference.values()):
        reference = None  # a dtype this reader does not take, or more dims than weights have
    if got is None:
        return "known bug"
    if isinstance(got, Refused):
        assert isinstance(got.error, TensorFileError) and str(got.error)
        assert reference is None, f"refused what the reference reader accepts: {got.error}"
        return "refused"
    check_header(got, len(buf))
    if reference is not None:
        assert {n: (t.dtype, list(t.shape)) for n, t in got.tensors.items()} == reference
    return "accepted, as the reference does" if reference else "accepted"


ADAPTER_BUGS = ("json-depth", "json-digits", "shape-product", "alpha-overflow")


def example_pool(model_dir: Path) -> PoolConfigured:
    """The pool `init_pool` configures for the example model: every module, max rank 16."""
    info = read_model(model_dir)
    return PoolConfigured(info.fingerprint, info.config, info.num_layers, info.module_dims,
                          4, 16, MODULES, "float32", log_id=LOG_ID)


def check_adapter(path: Path, pool: PoolConfigured) -> str:
    """The oracle for inspect_adapter: an AdapterError, or a candidate that holds exactly the
    directory's weights and a rank, alpha and targets the pool takes."""
    got = decode(lambda: inspect_adapter(path, pool), AdapterError, known=ADAPTER_BUGS)
    if got is None:
        return "known bug"
    if isinstance(got, Refused):
        assert isinstance(got.error, AdapterError)
        assert got.error.code in {"invalid_adapter", "unsupported"}, got.error.code
        return f"refused: {got.error.code}"
    weights = (path / "adapter_model.safetensors").read_bytes()
    cfg = json.loads((path / "adapter_config.json").read_text())
    assert got.weights == weights and got.sha256 == hashlib.sha256(weights).hexdigest()
    assert got.rank == cfg["r"] and 1 <= got.rank <= pool.max_rank
    assert math.isfinite(got.alpha) and got.alpha > 0 and math.isfinite(got.scaling)
    assert got.targets and set(got.targets) <= set(pool.targets)
    return "accepted"


def diff_cases(pool: PoolConfigured) -> tuple[State, list[dict[str, Any]]]:
    """A state with a pool and one adapter, and real diffs of each kind to mutate."""
    loaded = AdapterLoaded("a", 2, "0" * 64, 10, 2, 8.0, 4.0, False, ("q_proj",), False)
    state = apply(apply(State(), 1, pool), 2, loaded)
    other = AdapterLoaded("b", 3, "1" * 64, 10, 2, 8.0, 4.0, False, ("q_proj",), True)
    return state, [diff_of(1, pool, log_id=LOG_ID), diff_of(3, other, log_id=LOG_ID),
                   diff_of(3, AdapterUnloaded("a", 2), log_id=LOG_ID)]


def check_diff(diff: Any, state: State) -> str:
    """The oracle for body_of_diff: an EventError, or a body that `apply` takes or refuses
    with its own error."""
    got = decode(lambda: body_of_diff(diff), EventError, known=("diff-overflow",))
    if got is None:
        return "known bug"
    if isinstance(got, Refused):
        return "refused"
    seq, body = got
    # the identity fields that got in: the diff's log and, in a configure diff, the pool's
    assert type(seq) is int and 1 <= seq <= 2**62
    assert diff.get("log_id") is None or UUID_RE.fullmatch(diff["log_id"])
    assert not isinstance(body, PoolConfigured) or body.log_id is None \
        or UUID_RE.fullmatch(body.log_id)
    after = decode(lambda: apply(state, seq, body), (ReducerError, EventError),
                   known=("diff-types",))
    return "applied" if isinstance(after, State) else "refused by apply"


HEARTBEAT = {"head_seq": 3, "digest": "0" * 64, "ts": 1795964703.02, "log_id": LOG_ID}


def check_heartbeat(hb: Any) -> str:
    """The oracle for a replica's reading of statesvc's heartbeat: a ProtocolError, or a
    heartbeat whose head is an int in range and whose log id is null or a lowercase UUID."""
    got = decode(lambda: validate(PUBLISHED_HEARTBEAT, hb, "hb"), ProtocolError)
    if isinstance(got, Refused):
        assert isinstance(got.error, ProtocolError)
        assert got.error.code == "bad_request" and (got.error.field or "hb").startswith("hb")
        return "refused"
    assert type(got["head_seq"]) is int and 0 <= got["head_seq"] <= 2**62
    assert got["log_id"] is None or UUID_RE.fullmatch(got["log_id"])
    assert isinstance(got["ts"], float)
    return "accepted"
