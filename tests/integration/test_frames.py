"""Malformed control frames: each gets an error reply naming what is wrong, nothing is recorded,
and the service answers the next good request.

The unit tests call `shared.protocol.decode_request` directly; the rest talk to a real
`statesvc serve` over raw DEALER and REQ sockets, bypassing ControlClient.
"""
from __future__ import annotations

import datetime
import json
import shutil
import struct
import uuid
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import msgpack
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from shared.client import ControlClient, new_event_id
from shared.config import MAX_FRAME_BYTES, MAX_WIRE_BYTES
from shared.protocol import ProtocolError, decode_request, pack, unpack
from statesvc.tools.example import ExampleAssets
from testkit.fleet import StateSvc

REPLY_WAIT_MS = 20_000  # a generous wait for a reply that must come; nothing asserts on time


def request(cmd: str = "list", args: Any = None, **envelope: Any) -> dict[str, Any]:
    req: dict[str, Any] = {"v": 1, "id": "req-1", "cmd": cmd}
    if args is not None:
        req["args"] = args
    req.update(envelope)
    return req


def pool_init_args(**override: Any) -> dict[str, Any]:
    args = {"event_id": new_event_id(), "model": "/nonexistent/model", "max_loras": 8,
            "max_rank": 32, "targets": "all"}
    args.update(override)
    return args


def nested(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


class Case(NamedTuple):
    frame: bytes
    code: str
    field: str | None  # the field the error must name (in error.field and in the message)
    says: str  # a phrase the message must contain
    echoes_id: bool  # the reply carries the request's id ("req-1")


GOOD = pack(request())
WITH_ID = b"\x84\xa1v\x01\xa2id\xa5req-1"  # the first two entries of a 4-entry request map

CASES: dict[str, Case] = {
    "truncated msgpack": Case(GOOD[:-4], "bad_frame", None, "incomplete input", False),
    "truncated mid-string": Case(WITH_ID + b"\xa3cmd\xa4li", "bad_frame", None,
                                 "incomplete input", False),
    "garbage": Case(b"\xc1\xc1\xc1 not msgpack at all", "bad_frame", None,
                    "not a valid msgpack frame", False),
    "text": Case(b"GET / HTTP/1.1\r\n\r\n", "bad_frame", None, "not a valid msgpack frame",
                 False),
    "trailing bytes": Case(GOOD + b"\xc0", "bad_frame", None, "extra data", False),
    "invalid utf-8": Case(WITH_ID + b"\xa3cmd\xa2\xff\xfe\xa4args\x80", "bad_frame", None,
                          "utf-8", False),
    "array, not a map": Case(pack(["list", {}]), "bad_request", "request", "must be a map",
                             False),
    "int, not a map": Case(pack(7), "bad_request", "request", "must be a map", False),
    "nil": Case(pack(None), "bad_request", "request", "must be a map", False),
    "int map key": Case(pack({1: 2}), "bad_frame", None, "map key", False),
    "bin map key": Case(pack({b"v": 1, "id": "req-1", "cmd": "list"}), "bad_frame", None,
                        "map keys must be strings", False),
    "str and bin keys in args": Case(pack(request("events", {b"since": 0, "until": 1})),
                                     "bad_frame", None, "map keys must be strings", False),
    "v as str": Case(pack(request(v="1")), "bad_request", "request.v", "must be int, got str",
                     True),
    "v as bool": Case(pack(request(v=True)), "bad_request", "request.v",
                      "must be int, got bool", True),
    "v as float": Case(pack(request(v=1.0)), "bad_request", "request.v",
                       "must be int, got float", True),
    "v from the future": Case(pack(request(v=2)), "bad_request", "request.v",
                              "must be between 1 and 1", True),
    "v missing": Case(pack({"id": "req-1", "cmd": "list"}), "bad_request", "request.v",
                      "is required", True),
    "id as bytes": Case(pack(request(id=b"req-1")), "bad_request", "request.id",
                        "must be str, got bytes", False),
    "id too long": Case(pack(request(id="x" * 65)), "bad_request", "request.id",
                        "1 to 64 characters", False),
    "cmd as int": Case(pack(request(cmd=3)), "bad_request", "request.cmd", "must be str", True),
    "args as list": Case(pack(request(args=[1, 2])), "bad_request", "request.args",
                         "must be dict, got list", True),
    "max_loras as str": Case(pack(request("pool.init", pool_init_args(max_loras="8"))),
                             "bad_request", "args.max_loras", "must be int, got str", True),
    "max_loras as bool": Case(pack(request("pool.init", pool_init_args(max_loras=True))),
                              "bad_request", "args.max_loras", "must be int, got bool", True),
    "max_rank as float": Case(pack(request("pool.init", pool_init_args(max_rank=8.0))),
                              "bad_request", "args.max_rank", "must be int, got float", True),
    "max_loras out of range": Case(pack(request("pool.init", pool_init_args(max_loras=0))),
                                   "bad_request", "args.max_loras", "between 1 and 4096", True),
    "pin as int": Case(pack(request("load", {"event_id": new_event_id(), "name": "a",
                                             "path": "/a", "pin": 1})),
                       "bad_request", "args.pin", "must be bool, got int", True),
    "since as bool": Case(pack(request("events", {"since": False})), "bad_request",
                          "args.since", "must be int, got bool", True),
    "since negative": Case(pack(request("events", {"since": -1})), "bad_request",
                           "args.since", "between 0 and", True),
    "since above int64": Case(pack(request("events", {"since": 2**64 - 1})), "bad_request",
                              "args.since", "between 0 and", True),
    "event_id not a uuid": Case(pack(request("unload", {"event_id": "1", "name": "a"})),
                                "bad_request", "args.event_id", "lowercase UUID", True),
    "event_id uppercase": Case(pack(request("unload", {"event_id": str(uuid.uuid4()).upper(),
                                                       "name": "a"})),
                               "bad_request", "args.event_id", "lowercase UUID", True),
    "required arg missing": Case(pack(request("unload", {"event_id": new_event_id()})),
                                 "bad_request", "args.name", "is required", True),
    "targets not modules": Case(pack(request("pool.init", pool_init_args(targets=["lm_head"]))),
                                "bad_request", "args.targets", "q_proj", True),
    "unknown envelope field": Case(pack(request(extra=1)), "bad_request", "request.extra",
                                   "unknown field 'extra'", True),
    "unknown arg": Case(pack(request("events", {"since": 0, "until": 5})), "bad_request",
                        "args.until", "unknown field 'until'", True),
    "unknown arg of a write": Case(pack(request("pool.init", pool_init_args(slots=4))),
                                   "bad_request", "args.slots", "unknown field 'slots'", True),
    "unknown command": Case(pack(request("drop_table")), "unknown_command", "request.cmd",
                            "unknown command 'drop_table'", True),
    "ext type": Case(pack(request("events", {"since": msgpack.ExtType(42, b"\x00" * 8)})),
                     "bad_frame", None, "ext type 42", False),
    "ext type as the frame": Case(pack(msgpack.ExtType(1, b"")), "bad_frame", None,
                                  "ext type 1", False),
    "timestamp": Case(pack(request("events", {"since": msgpack.Timestamp(1_700_000_000, 5)})),
                      "bad_frame", None, "Timestamp", False),
    "datetime": Case(msgpack.packb(request("events", {"since": datetime.datetime(
        2024, 1, 1, tzinfo=datetime.timezone.utc)}), datetime=True), "bad_frame", None,
        "Timestamp", False),
    "nested 40 deep": Case(pack(request("events", {"since": nested(40)})), "bad_frame", None,
                           "deeper than 32 levels", False),
    "nested 100000 deep": Case(b"\x91" * 100_000 + b"\xc0", "bad_frame", None,
                               "not a valid msgpack frame", False),
    "maps nested 100000 deep": Case(b"\x81\xa1a" * 100_000 + b"\xc0", "bad_frame", None,
                                    "not a valid msgpack frame", False),
    "str32 claiming 4 GiB": Case(b"\xdb\xff\xff\xff\xffabc", "bad_frame", None,
                                 "incomplete input", False),
    "str32 claiming 4 GiB inside the map": Case(WITH_ID + b"\xa3cmd\xdb\xff\xff\xff\xffli",
                                                "bad_frame", None, "incomplete input", False),
    "bin32 claiming 4 GiB": Case(b"\xc6\xff\xff\xff\xff\x00", "bad_frame", None,
                                 "incomplete input", False),
    "array32 claiming 4G items": Case(b"\xdd\xff\xff\xff\xff\xc0", "bad_frame", None,
                                      "max_array_len", False),
    "map32 claiming 4G entries": Case(b"\xdf\xff\xff\xff\xff\xc0\xc0", "bad_frame", None,
                                      "max_map_len", False),
    "ext32 claiming 4 GiB": Case(b"\xc9\xff\xff\xff\xff\x05\x00", "bad_frame", None,
                                 "not a valid msgpack frame", False),
    "over 1 MiB": Case(pack(request("events", {"since": b"\x00" * MAX_FRAME_BYTES})),
                       "too_large", None, f"{MAX_FRAME_BYTES}-byte limit", False),
    "empty frame": Case(b"", "bad_frame", None, "incomplete input", False),
}


# ---- decode_request, in-process ------------------------------------------------


@pytest.mark.parametrize("name", CASES)
def test_decode_request_refuses(name: str) -> None:
    case = CASES[name]
    with pytest.raises(ProtocolError) as info:
        decode_request(case.frame)
    err = info.value
    assert err.code == case.code, str(err)
    assert err.field == case.field, str(err)
    assert case.says in str(err)
    if case.field is not None and case.code != "unknown_command":
        assert case.field.rsplit(".", 1)[-1] in str(err)  # the message names the field too


def test_decode_request_accepts_and_fills_defaults() -> None:
    req = decode_request(pack(request("events", {"since": 3})))
    assert (req.id, req.cmd, req.args) == ("req-1", "events", {"since": 3, "limit": 1000})
    assert decode_request(pack(request("status", None))).args == {}
    assert decode_request(pack({"v": 1, "id": "i", "cmd": "status", "args": None})).args == {}
    eid = new_event_id()
    req = decode_request(pack(request("unload", {"event_id": eid, "name": "a",
                                                 "expect_head": None})))
    assert req.args == {"event_id": eid, "name": "a", "expect_head": None, "force": False}
    # A frame of exactly MAX_FRAME_BYTES passes the size check (and fails on its content).
    overhead = len(pack(request("list", None, pad=b"\x00" * (1 << 17)))) - (1 << 17)
    at_limit = pack(request("list", None, pad=b"\x00" * (MAX_FRAME_BYTES - overhead)))
    assert len(at_limit) == MAX_FRAME_BYTES
    with pytest.raises(ProtocolError, match="unknown field 'pad'"):
        decode_request(at_limit)
    over = pack(request("list", None, pad=b"\x00" * (MAX_FRAME_BYTES - overhead + 1)))
    with pytest.raises(ProtocolError, match="1048577 bytes") as info:
        decode_request(over)
    assert info.value.code == "too_large"


# ---- a real statesvc over raw sockets ------------------------------------------


class Live(NamedTuple):
    svc: StateSvc
    ctx: zmq.Context[Any]
    head: int


@pytest.fixture(scope="module")
def live(example: ExampleAssets, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    """One statesvc with a pool and one adapter (head seq 2), shared by the tests below."""
    svc = StateSvc(tmp_path_factory.mktemp("frames") / "data")
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        svc.start()
        with ControlClient(svc.control, timeout_s=20, retries=0, context=ctx) as c:
            c.call("pool.init", {"event_id": new_event_id(), "model": str(example.model_dir),
                                 "max_loras": 8, "max_rank": 32, "targets": "all"})
            adapter = next(iter(example.adapter_dirs))
            c.call("load", {"event_id": new_event_id(), "name": adapter,
                            "path": str(example.adapter_dirs[adapter])})
        yield Live(svc, ctx, 2)
        assert svc.proc is not None and svc.proc.poll() is None, "statesvc died"
    finally:
        svc.stop()
        ctx.destroy(linger=0)


def dealer(live: Live) -> zmq.Socket[Any]:
    sock = live.ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(live.svc.control)
    return sock


def exchange(sock: zmq.Socket[Any], frames: list[bytes]) -> list[bytes]:
    sock.send_multipart(frames)
    assert sock.poll(REPLY_WAIT_MS), "no reply"
    return sock.recv_multipart()


def assert_error(reply: bytes, case: Case) -> None:
    msg = unpack(reply)
    assert msg["v"] == 1 and msg["ok"] is False, msg
    assert msg["error"]["code"] == case.code, msg
    assert case.says in msg["error"]["message"], msg
    assert msg["error"].get("field") == case.field, msg
    assert msg["id"] == ("req-1" if case.echoes_id else None), msg


def assert_serving(sock: zmq.Socket[Any], live: Live, *, envelope: list[bytes] | None = None
                   ) -> None:
    """A good request on `sock` is answered, and the log has not moved."""
    req_id = uuid.uuid4().hex
    parts = exchange(sock, [*(envelope or []), pack(request("list", id=req_id))])
    assert parts[:-1] == (envelope or [])
    msg = unpack(parts[-1])
    assert msg["ok"] is True and msg["id"] == req_id, msg
    assert msg["result"]["head_seq"] == live.head


def test_bad_frames_over_a_dealer(live: Live) -> None:
    sock = dealer(live)
    try:
        assert_serving(sock, live)
        for name, case in CASES.items():
            parts = exchange(sock, [case.frame])
            assert len(parts) == 1, name
            assert_error(parts[0], case)
            assert_serving(sock, live)
    finally:
        sock.close(0)


def test_bad_frames_over_a_req_socket(live: Live) -> None:
    sock = live.ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(live.svc.control)
    try:
        for name in ("truncated msgpack", "array, not a map", "max_loras as str", "ext type",
                     "unknown command", "over 1 MiB", "empty frame", "str32 claiming 4 GiB"):
            sock.send(CASES[name].frame)
            assert sock.poll(REPLY_WAIT_MS), name
            assert_error(sock.recv(), CASES[name])
            sock.send(pack(request("list", id="good")))
            assert sock.poll(REPLY_WAIT_MS)
            msg = unpack(sock.recv())
            assert (msg["ok"], msg["id"], msg["result"]["head_seq"]) == (True, "good", live.head)
    finally:
        sock.close(0)


def test_a_rejected_write_records_nothing(live: Live, example: ExampleAssets) -> None:
    """Writes that are well-formed msgpack but fail the schema append no event."""
    sock = dealer(live)
    path = str(next(iter(example.adapter_dirs.values())))
    try:
        for args in ({"event_id": new_event_id(), "name": "fresh", "path": path, "pin": "yes"},
                     {"event_id": new_event_id(), "name": "fresh", "path": path, "extra": 1},
                     {"event_id": new_event_id(), "name": 7, "path": path},
                     {"event_id": "not-a-uuid", "name": "fresh", "path": path}):
            msg = unpack(exchange(sock, [pack(request("load", args))])[0])
            assert msg["ok"] is False and msg["error"]["code"] == "bad_request", msg
            assert msg["error"]["field"].startswith("args."), msg
        assert_serving(sock, live)
    finally:
        sock.close(0)


def test_multipart_frames(live: Live) -> None:
    """A request is its last frame, after REQ's empty delimiter at most: the delimiter comes
    back; other leading frames get one bad_frame error, and none of them comes back."""
    sock = dealer(live)
    try:
        assert_serving(sock, live, envelope=[b""])
        # The last frame is the request: a good leading frame does not rescue a bad last one.
        for frames in ([b"extra", b"\xc1 not msgpack", b"", GOOD], [GOOD, b"\xc1 trailing junk"]):
            parts = exchange(sock, frames)
            assert len(parts) == 1
            assert_error(parts[0], Case(b"", "bad_frame", None, "a request is one frame", False))
        parts = exchange(sock, [b"", b""])  # delimiter and an empty body
        assert parts[0] == b""
        assert_error(parts[1], CASES["empty frame"])
        assert_serving(sock, live)
    finally:
        sock.close(0)


def test_frame_over_the_socket_limit_drops_only_that_peer(live: Live) -> None:
    """libzmq disconnects a peer that sends more than MAX_WIRE_BYTES; the others are served."""
    bystander = dealer(live)
    big = dealer(live)  # no MAXMSGSIZE of its own: it will send what the service refuses
    monitor = big.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        assert_serving(bystander, live)
        assert_serving(big, live)
        big.send(b"\x00" * (MAX_WIRE_BYTES + (1 << 20)))
        assert monitor.poll(REPLY_WAIT_MS), "the service did not drop the oversized peer"
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
        assert_serving(bystander, live)
        assert_serving(big, live)  # it reconnects by itself and is served again
        assert live.svc.proc is not None and live.svc.proc.poll() is None
    finally:
        big.disable_monitor()
        monitor.close(0)
        big.close(0)
        bystander.close(0)


def test_log_unchanged_after_the_barrage(live: Live) -> None:
    with ControlClient(live.svc.control, timeout_s=20, retries=0, context=live.ctx) as c:
        events = c.call("events", {"since": 0})
        status = c.call("status")
    assert events["head_seq"] == status["head_seq"] == live.head
    assert [e["seq"] for e in events["events"]] == [1, 2]
    assert [e["type"] for e in events["events"]] == ["pool.configured", "adapter.loaded"]


# ---- well-formed frames naming unreadable files must not end the service ---------


def _serves_after(svc: StateSvc, frame: bytes) -> tuple[dict[str, Any], dict[str, Any]]:
    """Send `frame` then a good request on a raw DEALER; both replies, or AssertionError."""
    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(svc.control)

    def reply() -> dict[str, Any] | None:
        assert svc.proc is not None
        for _ in range(REPLY_WAIT_MS // 100):  # stop waiting as soon as the service is gone
            if sock.poll(100):
                return dict(unpack(sock.recv()))
            if svc.proc.poll() is not None:
                return None
        return None

    try:
        sock.send(frame)
        first = reply()
        sock.send(pack(request("list", id="after")))
        second = reply()
        assert svc.proc is not None and svc.proc.poll() is None, (
            f"statesvc exited ({svc.proc.returncode if svc.proc else None}); see {svc.log}")
        assert first is not None and second is not None
        return first, second
    finally:
        sock.close(0)
        ctx.destroy(linger=0)


def _bad_safetensors() -> bytes:
    """A safetensors file whose header gives a tensor's dtype as a list."""
    header = json.dumps({"t": {"dtype": [], "shape": [0], "data_offsets": [0, 0]}}).encode()
    return struct.pack("<Q", len(header)) + header


def test_unreadable_models_do_not_end_the_service(statesvc: StateSvc, example: ExampleAssets,
                                                  tmp_path: Path) -> None:
    config = (example.model_dir / "config.json").read_bytes()
    defects = {
        "config.json not utf-8": {"config.json": b"\xff\xfe" + config},
        "config.json a directory": {"config.json": None},
        "index weight_map a list": {"config.json": config,
                                    "model.safetensors.index.json": b'{"weight_map": []}'},
        "index shard names not str": {"config.json": config,
                                      "model.safetensors.index.json": b'{"weight_map": {"a": 1}}'},
        "tensor dtype a list": {"config.json": config, "model.safetensors": _bad_safetensors()},
    }
    for i, (defect, files) in enumerate(defects.items()):
        model = tmp_path / f"model{i}"
        model.mkdir()
        for name, content in files.items():
            if content is None:
                (model / name).mkdir()
            else:
                (model / name).write_bytes(content)
        first, second = _serves_after(statesvc, pack(request("pool.init", pool_init_args(
            model=str(model)))))
        assert first["ok"] is False and first["error"]["code"] == "invalid_model", defect
        assert first["error"]["field"] == "args.model", defect
        assert second["ok"] is True and second["result"]["head_seq"] == 0, defect


def test_adapter_with_a_lying_header_does_not_end_the_service(
        statesvc: StateSvc, example: ExampleAssets, tmp_path: Path) -> None:
    with ControlClient(statesvc.control, timeout_s=20, retries=0) as c:
        c.call("pool.init", pool_init_args(model=str(example.model_dir)))
    adapter = tmp_path / "adapter"
    shutil.copytree(next(iter(example.adapter_dirs.values())), adapter)
    (adapter / "adapter_model.safetensors").write_bytes(_bad_safetensors())
    first, second = _serves_after(statesvc, pack(request("load", {
        "event_id": new_event_id(), "name": "liar", "path": str(adapter)})))
    assert first["ok"] is False and first["error"]["code"] == "invalid_adapter"
    assert second["ok"] is True and second["result"]["head_seq"] == 1
