"""statesvc as a real subprocess, driven through loractl and a raw ZeroMQ client."""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from shared.client import ControlClient, RemoteError, new_event_id
from statesvc.tools.example import ExampleAssets
from testkit.fleet import BIN, StateSvc, free_port, loractl
from tests.helpers import dealer


def raw_call(sock: zmq.Socket[Any], cmd: str, args: dict[str, Any]) -> dict[str, Any]:
    req_id = uuid.uuid4().hex
    sock.send(msgpack.packb({"v": 1, "id": req_id, "cmd": cmd, "args": args}))
    assert sock.poll(10_000), f"no reply to {cmd}"
    reply = msgpack.unpackb(sock.recv())
    assert reply["id"] == req_id
    return reply


@pytest.fixture
def raw(statesvc: StateSvc) -> Any:
    sock = dealer(statesvc.control)
    yield sock
    sock.close(0)


def js(res: subprocess.CompletedProcess[str]) -> Any:
    return json.loads(res.stdout)


def test_lifecycle_through_loractl_and_restart(statesvc: StateSvc, example: ExampleAssets,
                                               raw: zmq.Socket[Any]) -> None:
    ad = example.adapter_dirs
    init = js(loractl(statesvc, "pool", "init", "--model", str(example.model_dir),
                      "--max-loras", "4", "--max-rank", "16", "--targets", "all", "--json"))
    assert init["seq"] == 1 and init["max_loras"] == 4 and len(init["targets"]) == 7

    a = js(loractl(statesvc, "load", "chat", str(ad["attn-qv-r8"]), "--json"))
    assert a == {"seq": 2, "name": "chat", "version": 2}
    b = js(loractl(statesvc, "load", "sql", str(ad["mlp-only-r16"]), "--pin", "--json"))
    assert b == {"seq": 3, "name": "sql", "version": 3}

    # an idempotent retry over the raw socket: recorded once, answered with the original result
    event_id = new_event_id()
    args = {"event_id": event_id, "name": "code", "path": str(ad["all-r2"])}
    first = raw_call(raw, "load", args)
    again = raw_call(raw, "load", args)
    assert first["ok"] and again["ok"] and again["result"] == first["result"]
    assert first["result"]["seq"] == 4 and "slot" not in first["result"]

    # replace: one event, the old version recorded as replaced
    rep = js(loractl(statesvc, "load", "chat", str(ad["attn-all-r4"]), "--replace", "--json"))
    assert rep == {"seq": 5, "name": "chat", "version": 5}
    refused = loractl(statesvc, "unload", "sql", check=False)
    assert refused.returncode == 1 and "pinned" in refused.stderr and refused.stdout == ""
    un = js(loractl(statesvc, "unload", "code", "--json"))
    assert un == {"seq": 6, "name": "code", "version": 4}

    listed = js(loractl(statesvc, "list", "--json"))
    assert [x["name"] for x in listed] == ["chat", "sql"]
    chat = listed[0]
    assert set(chat) == {"name", "version", "rank", "alpha", "scaling", "targets", "sha256",
                         "pinned"}
    assert (chat["version"], chat["rank"], chat["alpha"], chat["scaling"]) == (5, 4, 4.0, 1.0)
    assert chat["sha256"] == hashlib.sha256(
        (ad["attn-all-r4"] / "adapter_model.safetensors").read_bytes()).hexdigest()
    assert listed[1]["pinned"] is True
    # paging: --json stays a list
    assert js(loractl(statesvc, "list", "--limit", "1", "--json")) == listed[:1]
    assert js(loractl(statesvc, "list", "--after", "chat", "--json")) == listed[1:]
    assert "next page: loractl list --limit 1 --after chat" in \
        loractl(statesvc, "list", "--limit", "1").stdout

    events = js(loractl(statesvc, "events", "--json"))
    assert [e["seq"] for e in events] == [1, 2, 3, 4, 5, 6]
    assert all(set(e) == {"seq", "event_id", "type", "payload", "recorded_at", "actor"}
               for e in events)
    assert {e["actor"] for e in events} == {"local"}  # no --auth: every event is local
    assert [e["type"] for e in events] == ["pool.configured"] + ["adapter.loaded"] * 4 + \
        ["adapter.unloaded"]
    assert events[3]["event_id"] == event_id
    assert events[4]["payload"]["replaces"] == {"version": 2}
    assert [e["seq"] for e in js(loractl(statesvc, "events", "--since", "4", "--json"))] == [5, 6]

    status = js(loractl(statesvc, "status", "--json"))
    assert status["head_seq"] == 6 and status["replicas"] == []
    human = loractl(statesvc, "list").stdout
    assert "chat" in human and "2 of 100000 adapters registered (4 slots per replica)" in human

    statesvc.stop()
    statesvc.start()
    assert js(loractl(statesvc, "status", "--json"))["digest"] == status["digest"]
    assert js(loractl(statesvc, "list", "--json")) == listed
    assert js(loractl(statesvc, "events", "--json")) == events


def test_diffs_and_heartbeats_are_published(statesvc: StateSvc, example: ExampleAssets) -> None:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(statesvc.publish)
    try:
        # a heartbeat proves the subscription is live before the commands go out
        assert sub.poll(5000)
        topic, frame = sub.recv_multipart()
        assert topic == b"hb" and msgpack.unpackb(frame)["head_seq"] == 0
        with ControlClient(statesvc.control) as c:
            c.call("pool.init", {"event_id": new_event_id(), "model": str(example.model_dir),
                                 "max_loras": 2, "max_rank": 8, "targets": ["q_proj", "v_proj"]})
            c.call("load", {"event_id": new_event_id(), "name": "x",
                            "path": str(example.adapter_dirs["attn-qv-r8"])})
            c.call("unload", {"event_id": new_event_id(), "name": "x"})
        diffs: list[dict[str, Any]] = []
        beats: list[dict[str, Any]] = []
        deadline = time.monotonic() + 10
        while (len(diffs) < 3 or not beats or beats[-1]["head_seq"] < 3) \
                and time.monotonic() < deadline:
            if sub.poll(500):
                topic, frame = sub.recv_multipart()
                (diffs if topic == b"diff" else beats).append(msgpack.unpackb(frame))
        assert [(d["seq"], d["op"]) for d in diffs] == [(1, "configure"), (2, "load"),
                                                         (3, "unload")]
        load = diffs[1]
        assert (load["name"], load["version"], load["rank"], load["alpha"],
                load["targets"]) == ("x", 2, 8, 16.0, ["q_proj", "v_proj"])
        assert "slot" not in load  # which slot holds it is each replica's choice
        assert load["sha256"] == hashlib.sha256((example.adapter_dirs["attn-qv-r8"] /
                                                 "adapter_model.safetensors").read_bytes()
                                                ).hexdigest()
        assert beats[-1]["head_seq"] == 3 and len(beats[-1]["digest"]) == 64
    finally:
        sub.close(0)


def test_blobs_served_in_chunks_after_source_is_deleted(statesvc: StateSvc,
                                                       example: ExampleAssets,
                                                       tmp_path: Path) -> None:
    src = tmp_path / "adapter"
    shutil.copytree(example.adapter_dirs["all-r2"], src)
    original = (src / "adapter_model.safetensors").read_bytes()
    with ControlClient(statesvc.control) as c:
        c.call("pool.init", {"event_id": new_event_id(), "model": str(example.model_dir),
                             "max_loras": 2, "max_rank": 8, "targets": "all"})
        c.call("load", {"event_id": new_event_id(), "name": "x", "path": str(src)})
    shutil.rmtree(src)
    statesvc.stop()
    statesvc.start()
    sha = hashlib.sha256(original).hexdigest()
    with ControlClient(statesvc.control) as c:
        [entry] = c.call("list")["adapters"]
        assert entry["sha256"] == sha
        got, offset = b"", 0
        while True:
            chunk = c.call("blob", {"sha256": sha, "offset": offset, "length": 1000})
            assert chunk["size"] == len(original)
            got += chunk["data"]
            offset += len(chunk["data"])
            if offset >= chunk["size"]:
                break
        assert got == original
        with pytest.raises(RemoteError) as missing:
            c.call("blob", {"sha256": "0" * 64})
        assert missing.value.code == "not_found"


def test_expect_head_conflict_names_the_head(statesvc: StateSvc, example: ExampleAssets) -> None:
    loractl(statesvc, "pool", "init", "--model", str(example.model_dir), "--max-loras", "2",
            "--max-rank", "8", "--targets", "all")
    res = loractl(statesvc, "load", "x", str(example.adapter_dirs["all-r2"]), "--expect-head",
                  "0", check=False)
    assert res.returncode == 1
    assert "conflict" in res.stderr and "head is at seq 1" in res.stderr
    ok = js(loractl(statesvc, "load", "x", str(example.adapter_dirs["all-r2"]), "--expect-head",
                    "1", "--json"))
    assert ok["seq"] == 2


def test_pool_settings_are_immutable(statesvc: StateSvc, example: ExampleAssets) -> None:
    args = ["pool", "init", "--model", str(example.model_dir), "--max-loras", "2",
            "--max-rank", "8", "--targets", "q_proj,v_proj", "--json"]
    first = js(loractl(statesvc, *args))
    assert js(loractl(statesvc, *args)) == {**first, "created": False}
    other = loractl(statesvc, *args[:-2], "all", check=False)
    assert other.returncode == 1 and "already_configured" in other.stderr
    assert "new --data-dir" in other.stderr
    assert js(loractl(statesvc, "status", "--json"))["head_seq"] == 1


def test_req_socket_clients_work(statesvc: StateSvc) -> None:
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(statesvc.control)
    try:
        reply = raw_call(sock, "status", {})
        assert reply["ok"] and reply["result"]["head_seq"] == 0
    finally:
        sock.close(0)


def test_loractl_says_when_statesvc_is_down() -> None:
    res = subprocess.run([str(BIN / "loractl"), "--state", f"tcp://127.0.0.1:{free_port()}",
                          "--timeout", "0.2", "list"], capture_output=True, text=True,
                         timeout=30)
    assert res.returncode == 3 and "no answer from" in res.stderr and "is it running" in res.stderr


def test_single_writer_per_data_dir(statesvc: StateSvc) -> None:
    second = StateSvc(statesvc.data_dir)
    with pytest.raises(RuntimeError, match="did not start"):
        second.start()
    log = statesvc.log.read_text()
    assert "another statesvc is already serving" in log


def test_migrate_only(tmp_path: Path) -> None:
    res = subprocess.run([str(BIN / "statesvc"), "migrate", "--data-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "schema is at head" in res.stdout
    import sqlite3
    with sqlite3.connect(tmp_path / "state.db") as db:
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        triggers = {r[0] for r in db.execute(
            "SELECT name FROM sqlite_master WHERE type='trigger'")}
    assert {"events", "snapshots", "blobs", "alembic_version"} <= tables
    assert triggers == {"events_no_update", "events_no_delete"}


def test_status_marks_a_replica_that_disagrees(statesvc: StateSvc, example: ExampleAssets,
                                               raw: zmq.Socket[Any]) -> None:
    loractl(statesvc, "pool", "init", "--model", str(example.model_dir), "--max-loras", "2",
            "--max-rank", "8", "--targets", "all")
    digest = js(loractl(statesvc, "status", "--json"))["digest"]
    beat = {"address": "tcp://127.0.0.1:1", "state": "ACTIVE", "applied_seq": 1,
            "pool_digest": "none"}
    assert raw_call(raw, "heartbeat", {**beat, "id": "good", "logical_digest": digest})["ok"]
    assert raw_call(raw, "heartbeat", {**beat, "id": "bad", "logical_digest": "f" * 64})["ok"]
    reps = {r["id"]: r for r in js(loractl(statesvc, "status", "--json"))["replicas"]}
    assert reps["good"]["agrees"] is True and reps["bad"]["agrees"] is False
    table = loractl(statesvc, "status").stdout
    assert "NO" in table.split("bad")[1].splitlines()[0]


def test_a_call_with_no_peer_gives_up_within_its_timeouts() -> None:
    """Nothing listens on the port: every try's send waits for a peer at most the timeout (it
    used to block forever when no peer was attached, as after a refused CURVE handshake)."""
    from shared.client import Unavailable

    with ControlClient(f"tcp://127.0.0.1:{free_port()}", timeout_s=0.2, retries=1) as c:
        with pytest.raises(Unavailable, match="2 tries"):
            c.call("status")


def test_loractl_prints_markup_and_control_characters_from_the_wire_as_text(
        statesvc: StateSvc, example: ExampleAssets, tmp_path: Path) -> None:
    hostile = "[/x]\x1b]0;owned\x07\x1b[2J"
    loractl(statesvc, "pool", "init", "--model", str(example.model_dir), "--max-loras", "2",
            "--max-rank", "8", "--targets", "all")
    res = loractl(statesvc, "unload", hostile, check=False)
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert "not_found" in res.stderr and "[/x]" in res.stderr
    assert "\x1b" not in res.stderr and "\x07" not in res.stderr and "\\x1b]0;owned" in res.stderr
    adapter = tmp_path / "hostile"
    shutil.copytree(example.adapter_dirs["all-r2"], adapter)
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**cfg, "peft_type": hostile}))
    res = loractl(statesvc, "load", "x", str(adapter), check=False)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert "invalid_adapter" in res.stderr and "\x1b" not in res.stderr
