"""Failover between statesvc instances of one PostgreSQL log (real server, real subprocesses):
clients, loractl and replicas given `a,b` move to b when a stops answering, and nothing is
lost, repeated or applied out of order. Also: blob chunks never hold up commands."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import zmq

from shared.client import ControlClient, new_event_id
from shared.endpoints import EndpointError, split_addresses
from shared.keys import ClientKeys
from shared.protocol import encode_request, unpack
from statesvc.tools.example import ExampleAssets
from testkit.fleet import BIN, Computed, Endpoints, StateSvc, alive, loopback, wait_for
from tests.helpers import fleet_keys


def both(a: StateSvc, b: StateSvc) -> Endpoints:
    return Endpoints(f"{a.control},{b.control}", f"{a.publish},{b.publish}")


def test_addresses_are_checked_one_by_one() -> None:
    assert split_addresses("tcp://127.0.0.1:1, tcp://127.0.0.1:2") == [
        "tcp://127.0.0.1:1", "tcp://127.0.0.1:2"]
    for bad, says in (("tcp://127.0.0.1:1,", "empty address"),
                      ("tcp://127.0.0.1:1,tcp://127.0.0.1:1", "twice"),
                      ("tcp://127.0.0.1:1,udp://x:2", "not a tcp:// or ipc://")):
        with pytest.raises(EndpointError, match=says):
            split_addresses(bad)


def test_a_client_moves_past_a_silent_address(tmp_path: Path) -> None:
    """The first address answers nothing: the call is answered by the second, and the client
    stays there; loractl does the same, and names every address when none answers."""
    svc = StateSvc(tmp_path / "s").start()
    dead = loopback()
    try:
        with ControlClient(f"{dead},{svc.control}", timeout_s=1, retries=0) as c:
            assert c.call("status")["head_seq"] == 0
            assert c.address == svc.control
            assert c.call("status")["head_seq"] == 0 and c.address == svc.control
        res = subprocess.run([str(BIN / "loractl"), "--state", f"{dead},{svc.control}",
                              "--timeout", "1", "status"], capture_output=True, text=True,
                             timeout=60)
        assert res.returncode == 0, res.stderr
        other = loopback()
        res = subprocess.run([str(BIN / "loractl"), "--state", f"{dead},{other}", "--timeout",
                              "0.5", "status"], capture_output=True, text=True, timeout=60)
        assert res.returncode == 3 and dead in res.stderr and other in res.stderr
    finally:
        svc.stop()


def test_computed_wants_a_diff_address_per_instance(tmp_path: Path,
                                                    example: ExampleAssets) -> None:
    res = subprocess.run([str(BIN / "computed"), "serve", "--model", str(example.model_dir),
                          "--state", "tcp://127.0.0.1:7100,tcp://127.0.0.1:7110",
                          "--diffs", "tcp://127.0.0.1:7101", "--cache-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "same order" in res.stderr


@pytest.mark.parametrize("curve", [False, True], ids=["plain", "curve"])
def test_a_replica_and_a_client_fail_over_when_an_instance_is_killed(
        curve: bool, pg_url: str, example: ExampleAssets, tmp_path: Path) -> None:
    """A replica follows a (the first of a,b); a is SIGKILLed; writes go on through b (the
    same client, resending with the same event_id); the replica moves to b, fills what it
    missed by seq, reaches statesvc's digest, and b lists it ACTIVE (its heartbeats moved).
    With CURVE both instances serve one key dir (one server key), so one --server-key does."""
    keys: ClientKeys | None = None
    key_args: tuple[str, ...] = ()
    auth: tuple[str, ...] = ()
    if curve:
        keydir, keys, key_args = fleet_keys(tmp_path)
        auth = ("--auth", str(keydir))
    a = StateSvc(tmp_path / "a", extra_args=("--db", pg_url, *auth))
    b = StateSvc(tmp_path / "b", extra_args=("--db", pg_url, *auth))
    replica = Computed(example.model_dir, both(a, b), tmp_path / "r", replica_id="r",
                       extra_args=("--no-warmup", "--no-inference", *key_args))
    client = ControlClient(both(a, b).control, timeout_s=2, retries=0, keys=keys)

    def write(cmd: str, **args: Any) -> int:
        return int(client.call(cmd, {"event_id": new_event_id(), **args})["seq"])

    def at(seq: int, svc: StateSvc) -> bool:
        st = replica.status()
        with ControlClient(svc.control, keys=keys) as c:
            listed = {r["id"]: r for r in c.call("status")["replicas"]}
        return bool(st["applied_seq"] == seq and st["state"] == "ACTIVE"
                    and listed.get("r", {}).get("state") == "ACTIVE"
                    and listed["r"]["applied_seq"] == seq)

    try:
        a.start()
        b.start()
        replica.start()
        assert write("pool.init", model=str(example.model_dir), max_loras=2, max_rank=16,
                     targets="all") == 1
        assert write("load", name="x", path=str(example.adapter_dirs["attn-qv-r8"])) == 2
        wait_for(lambda: at(2, a), what="the replica at seq 2, heartbeating to a")
        a.kill()
        assert write("load", name="y", path=str(example.adapter_dirs["mlp-only-r16"])) == 3
        assert client.address == b.control
        assert write("unload", name="x") == 4
        wait_for(lambda: at(4, b), what="the replica at seq 4 through b, heartbeating to b")
        with ControlClient(b.control, keys=keys) as c:
            assert replica.status()["logical_digest"] == c.call("status")["digest"]
        assert "following" in replica.log.read_text()
    finally:
        client.close()
        replica.stop()
        a.stop()
        b.stop()


def test_drill_kills_a_statesvc_and_replicas_stay_active_through_the_other(
        two: tuple[StateSvc, StateSvc], example: ExampleAssets, tmp_path: Path) -> None:
    """`loractl drill --kill-statesvc DATA_DIR` SIGKILLs the instance of that data dir (as
    its run.json says), sees every live replica ACTIVE at the head through the other,
    restarts the instance, and the usual agreement checks pass."""
    a, b = two
    replica = Computed(example.model_dir, both(a, b), tmp_path / "r", replica_id="r",
                       extra_args=("--no-warmup", "--max-batch", "4"))
    restarted = 0
    try:
        replica.start()
        with ControlClient(a.control) as c:
            c.call("pool.init", {"event_id": new_event_id(), "model": str(example.model_dir),
                                 "max_loras": 2, "max_rank": 16, "targets": "all"})
            c.call("load", {"event_id": new_event_id(), "name": "x",
                            "path": str(example.adapter_dirs["attn-qv-r8"])})
        wait_for(lambda: any(r["id"] == "r" and r["state"] == "ACTIVE" for r in ControlClient(
            a.control).call("status")["replicas"]), what="r heartbeating to a")
        res = subprocess.run([str(BIN / "loractl"), "--state", both(a, b).control, "--timeout",
                              "3", "drill", "--diffs", both(a, b).publish, "--json",
                              "--kill-statesvc", str(a.data_dir)],
                             capture_output=True, text=True, timeout=600)
        restarted = json.loads((a.data_dir / "run.json").read_text())["pid"]
        assert res.returncode == 0, res.stderr
        report = json.loads(res.stdout)
        assert report["ok"] and report["timings"]["statesvc_kill_to_active_s"] > 0
        assert report["restarted"]["statesvc"] == a.control
        assert [c["replica"] for c in report["checks"]
                if c["check"] == "active without the killed statesvc"] == ["r"]
        assert not a.running and restarted != a.pid  # killed, and another process serves
        assert ControlClient(a.control).call("status")["head_seq"] == 2
    finally:
        replica.stop()
        if restarted and restarted != a.pid and alive(restarted):
            os.kill(restarted, signal.SIGTERM)  # the drill's restart of a: ours to stop


def test_drill_refuses_to_kill_the_only_named_instance(
        two: tuple[StateSvc, StateSvc], example: ExampleAssets) -> None:
    a, _ = two
    res = subprocess.run([str(BIN / "loractl"), "--state", a.control, "drill", "--diffs",
                          a.publish, "--model", str(example.model_dir), "--kill-statesvc",
                          str(a.data_dir)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 3 and "another instance" in res.stderr and a.running


def test_a_command_and_heartbeats_go_on_while_a_blob_streams(tmp_path: Path,
                                                             example: ExampleAssets) -> None:
    """Blob chunks are read on statesvc's blob thread: with each chunk read held up (a test
    fault, 3 s a chunk), a command sent after a blob request is answered first, and
    heartbeats keep coming, while the blob's reply follows with the right bytes."""
    svc = StateSvc(tmp_path / "s", env={"LORAPLANE_FAULT_SLOW_BLOB_S": "3"}).start()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    blob_sock, sub = ctx.socket(zmq.DEALER), ctx.socket(zmq.SUB)
    try:
        adapter = example.adapter_dirs["attn-qv-r8"] / "adapter_model.safetensors"
        sha = hashlib.sha256(adapter.read_bytes()).hexdigest()
        with ControlClient(svc.control) as c:
            c.call("pool.init", {"event_id": new_event_id(), "model": str(example.model_dir),
                                 "max_loras": 2, "max_rank": 16, "targets": "all"})
            c.call("load", {"event_id": new_event_id(), "name": "x",
                            "path": str(adapter.parent)})
        for sock in (blob_sock, sub):
            sock.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"hb")
        sub.connect(svc.publish)
        blob_sock.connect(svc.control)
        blob_sock.send(encode_request("b", "blob", {"sha256": sha}))
        with ControlClient(svc.control, timeout_s=20, retries=0) as c:
            assert c.call("status")["head_seq"] == 2
        assert not blob_sock.poll(0)  # the command was answered while the chunk waited
        assert sub.poll(10_000) and sub.recv_multipart()[0] == b"hb"
        assert blob_sock.poll(30_000)
        reply = unpack(blob_sock.recv())
        assert reply["ok"] and reply["result"]["data"] == adapter.read_bytes()[:len(
            reply["result"]["data"])] and reply["result"]["size"] == adapter.stat().st_size
    finally:
        blob_sock.close(0)
        sub.close(0)
        svc.stop()
