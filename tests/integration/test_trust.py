"""Who may register a replica id, what the registry holds, the run files drills trust, and
a drill and role gating on a fleet where statesvc and every replica run with --auth."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import uuid
from pathlib import Path
from typing import Any, Iterator

import msgpack
import pytest
import zmq

from shared import runfile
from shared.client import ControlClient, RemoteError, Unavailable, new_event_id
from shared.config import MAX_REPLICAS, MAX_WIRE_BYTES, REPLICA_STALE_AFTER_S
from shared.keys import ClientKeys, client_keys
from statesvc.service import StateService
from statesvc.persistence.sqlite import FileBlobStore, SqliteEventStore, sqlite_url
from statesvc.tools.example import ExampleAssets
from testkit.fleet import BIN, Computed, StateSvc, wait_for
from testkit.fleet import alive
from testkit.inproc import CommandError, call, init_pool, open_service
from tests.helpers import make_keys, run

pytestmark = pytest.mark.timeout(180)

DIGEST = "0" * 64


def beat(rid: str, address: str = "tcp://127.0.0.1:7200", *, applied_seq: int = 0,
         logical_digest: str = DIGEST) -> dict[str, Any]:
    return {"id": rid, "address": address, "state": "ACTIVE", "applied_seq": applied_seq,
            "logical_digest": logical_digest, "pool_digest": "none"}


def keys_of(keydir: Path, clients: Path, name: str) -> ClientKeys:
    k = client_keys(str(clients / f"{name}.key_secret"), str(keydir / "server.key"))
    assert k is not None
    return k


@pytest.fixture
def keyed(tmp_path: Path) -> Iterator[tuple[StateSvc, Path, Path]]:
    keydir, clients = make_keys(tmp_path, {"alice": "operators", "r1": "replicas",
                                           "mallory": "replicas"})
    svc = StateSvc(tmp_path / "data", extra_args=("--auth", str(keydir)))
    try:
        yield svc.start(), keydir, clients
    finally:
        svc.stop()


# ---- the registry -------------------------------------------------------------------------


def test_under_auth_a_replica_id_belongs_to_the_key_that_registered_it(
        keyed: tuple[StateSvc, Path, Path]) -> None:
    svc, keydir, clients = keyed
    with ControlClient(svc.control, keys=keys_of(keydir, clients, "r1")) as r1, \
            ControlClient(svc.control, keys=keys_of(keydir, clients, "mallory")) as mallory, \
            ControlClient(svc.control, keys=keys_of(keydir, clients, "alice")) as alice:
        r1.call("heartbeat", beat("r1", "tcp://127.0.0.1:7301"))
        with pytest.raises(RemoteError) as taken:  # another replica key claims r1
            mallory.call("heartbeat", beat("r1", "tcp://127.0.0.1:7666"))
        assert taken.value.code == "forbidden" and "registered to replica:r1" in str(taken.value)
        with pytest.raises(RemoteError) as operator:  # only replica keys register replicas
            alice.call("heartbeat", beat("ops", "tcp://127.0.0.1:7667"))
        assert operator.value.code == "forbidden" and "only replica keys" in str(operator.value)
        with pytest.raises(RemoteError) as moved:  # the owner, elsewhere, while it is live
            r1.call("heartbeat", beat("r1", "tcp://127.0.0.1:7302"))
        assert moved.value.code == "conflict" and "STALE" in str(moved.value)
        [row] = alice.call("status")["replicas"]
    assert (row["id"], row["address"]) == ("r1", "tcp://127.0.0.1:7301")
    assert "previous_address" not in row


def test_without_auth_a_live_id_moves_only_once_stale_and_says_so(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    svc = StateService(SqliteEventStore(sqlite_url(tmp_path)), FileBlobStore(tmp_path / "blobs"),
                       clock=lambda: now[0])
    call(svc, "heartbeat", **beat("r1", "tcp://127.0.0.1:7301"))
    now[0] += REPLICA_STALE_AFTER_S - 1
    with pytest.raises(CommandError) as refused:  # a key-less peer claims a live id
        call(svc, "heartbeat", **beat("r1", "tcp://127.0.0.1:7666"))
    assert refused.value.code == "conflict" and "live at tcp://127.0.0.1:7301" in str(
        refused.value)
    assert [r["address"] for r in svc.status()["replicas"]] == ["tcp://127.0.0.1:7301"]
    now[0] += 2  # silent for longer than REPLICA_STALE_AFTER_S: STALE, the id may move
    assert svc.status()["replicas"][0]["state"] == "STALE"
    with caplog.at_level("WARNING", logger="statesvc"):
        call(svc, "heartbeat", **beat("r1", "tcp://127.0.0.1:7302"))
    [row] = svc.status()["replicas"]
    assert (row["address"], row["previous_address"]) == ("tcp://127.0.0.1:7302",
                                                         "tcp://127.0.0.1:7301")
    assert "moved from tcp://127.0.0.1:7301 to tcp://127.0.0.1:7302" in caplog.text


def raw_calls(address: str, calls: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Pipeline requests on one DEALER; the replies in request order."""
    sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_WIRE_BYTES)
    sock.connect(address)
    try:
        ids = [uuid.uuid4().hex for _ in calls]
        for req_id, (cmd, args) in zip(ids, calls):
            sock.send(msgpack.packb({"v": 1, "id": req_id, "cmd": cmd, "args": args}))
        replies = {}
        while len(replies) < len(ids):
            assert sock.poll(30_000), "no reply"
            reply = msgpack.unpackb(sock.recv())
            replies[reply["id"]] = reply
        return [replies[i] for i in ids]
    finally:
        sock.close(0)


def test_registry_refuses_bad_ids_and_addresses(statesvc: StateSvc) -> None:
    bad = [beat("[/x]"), beat("r1\x1b[2J"), beat("a b"), beat("x" * 65),
           beat("r1", "tcp://127.0.0.1:0;0.0.0.0:7100"), beat("r1", "tcp://h\x1b[31m:1"),
           beat("r1", "ipc:///" + "a" * 300), beat("r1", "inproc://x")]
    replies = raw_calls(statesvc.control, [("heartbeat", b) for b in bad])
    for b, reply in zip(bad, replies):
        assert reply["ok"] is False and reply["error"]["code"] == "bad_request", b
        assert reply["error"]["field"] in ("args.id", "args.address"), b
    assert "ZeroMQ endpoint" in replies[4]["error"]["message"]
    with ControlClient(statesvc.control) as c:
        assert c.call("status")["replicas"] == []


def test_registry_is_bounded_and_status_fits_one_reply(statesvc: StateSvc) -> None:
    longest = f"tcp://{'a' * 245}:7200"  # 256 characters, the longest address
    beats = [("heartbeat", beat(f"r{i:04d}-" + "x" * 58, longest)) for i in range(MAX_REPLICAS)]
    assert all(r["ok"] for r in raw_calls(statesvc.control, beats))
    [over] = raw_calls(statesvc.control, [("heartbeat", beat("one-too-many", longest))])
    assert over["ok"] is False and over["error"]["code"] == "overloaded"
    assert f"{MAX_REPLICAS} live replica ids (--max-replicas)" in over["error"]["message"]
    with ControlClient(statesvc.control) as c:  # the client's reply limit: MAX_WIRE_BYTES
        assert len(c.call("status")["replicas"]) == MAX_REPLICAS


def test_status_never_rebuilds_a_state_for_what_replicas_report(
        tmp_path: Path, example: ExampleAssets, monkeypatch: pytest.MonkeyPatch) -> None:
    svc = open_service(tmp_path / "d")
    init_pool(svc, example.model_dir)
    call(svc, "load", name="a", path=str(example.adapter_dirs["all-r2"]))
    call(svc, "load", name="b", path=str(example.adapter_dirs["attn-qv-r8"]))
    svc = open_service(tmp_path / "d")  # restarted: seqs 0-2 were never its heads
    head = svc.status()
    rebuilds: list[int | None] = []
    real = StateService.rebuild

    def counted(self: StateService, **kw: Any) -> Any:
        rebuilds.append(kw.get("until"))
        return real(self, **kw)

    monkeypatch.setattr(StateService, "rebuild", counted)
    for seq in range(3):
        call(svc, "heartbeat", **beat(f"old{seq}", applied_seq=seq))
    call(svc, "heartbeat", **beat("head", applied_seq=3, logical_digest=head["digest"]))
    call(svc, "heartbeat", **beat("liar", applied_seq=3))
    call(svc, "heartbeat", **beat("ahead", applied_seq=2**40))
    agrees = {r["id"]: r["agrees"] for r in svc.status()["replicas"]}
    assert rebuilds == []
    assert agrees == {"old0": None, "old1": None, "old2": None, "head": True, "liar": False,
                      "ahead": False}


# ---- run files ----------------------------------------------------------------------------


def test_run_file_is_trusted_only_when_ours_private_and_still_running(tmp_path: Path) -> None:
    sleeper = subprocess.Popen(["sleep", "600"])
    try:
        path = tmp_path / "cache" / runfile.RUN_FILE
        good = runfile.RunFile("r1", sleeper.pid, ("sleep", "600"), str(tmp_path),
                               "tcp://127.0.0.1:7200", str(tmp_path))
        runfile.write(path, good)
        assert path.stat().st_mode & 0o777 == 0o600
        assert runfile.read(path) == good
        runfile.check_running(good, path)
        path.chmod(0o620)  # group-writable: someone else could have written it
        with pytest.raises(runfile.RunFileError, match="not trusted"):
            runfile.read(path)
        path.chmod(0o600)
        reused = runfile.RunFile("r1", sleeper.pid, ("computed", "serve"), str(tmp_path),
                                 "tcp://127.0.0.1:7200", str(tmp_path))
        with pytest.raises(runfile.RunFileError, match="pid was reused"):
            runfile.check_running(reused, path)
        os.mkfifo(tmp_path / "fifo.json")  # not a file: refused without blocking
        with pytest.raises(runfile.RunFileError, match="not a regular file"):
            runfile.read(tmp_path / "fifo.json")
        with pytest.raises(runfile.RunFileError, match="cannot open"):
            runfile.read(tmp_path / "missing.json")
    finally:
        sleeper.send_signal(signal.SIGKILL)
        sleeper.wait(10)
    with pytest.raises(runfile.RunFileError, match="not running"):
        runfile.check_running(good, path)


# ---- a fleet where statesvc and every replica run with --auth ------------------------------


class AuthFleet:
    def __init__(self, tmp: Path, example: ExampleAssets) -> None:
        self.tmp = tmp
        self.keydir, self.clients = make_keys(tmp, {"alice": "operators", "r1": "replicas",
                                                    "r2": "replicas", "mallory": "replicas",
                                                    "app": None})
        self.replica_keys = tmp / "replica-keys"  # the replicas' listen sockets
        assert run("statesvc", "keys", "init", str(self.replica_keys)).returncode == 0
        shutil.copy(self.clients / "alice.key", self.replica_keys / "operators")
        shutil.copy(self.clients / "app.key", self.replica_keys / "clients")
        self.statesvc = StateSvc(tmp / "data", extra_args=("--auth", str(self.keydir)))
        self.replicas: dict[str, Computed] = {}
        self.example = example

    def key(self, name: str, server: Path | None = None) -> ClientKeys:
        k = client_keys(str(self.clients / f"{name}.key_secret"),
                        str((server or self.keydir) / "server.key"))
        assert k is not None
        return k

    def call(self, cmd: str, who: str = "alice", **args: Any) -> Any:
        with ControlClient(self.statesvc.control, keys=self.key(who)) as c:
            return c.call(cmd, args)

    def replica_call(self, rid: str, cmd: str, who: str, **args: Any) -> Any:
        with ControlClient(self.replicas[rid].listen, timeout_s=10, retries=0,
                           keys=self.key(who, self.replica_keys)) as c:
            return c.call(cmd, args)

    def start(self) -> AuthFleet:
        self.statesvc.start()
        self.call("pool.init", event_id=new_event_id(), model=str(self.example.model_dir),
                  max_loras=4, max_rank=16, targets="all")
        for name, adapter in (("chat", "attn-qv-r8"), ("code", "all-r2")):
            self.call("load", event_id=new_event_id(), name=name,
                      path=str(self.example.adapter_dirs[adapter]))
        for rid in ("r1", "r2"):
            self.replicas[rid] = Computed(
                self.example.model_dir, self.statesvc, self.tmp / "replicas" / rid,
                replica_id=rid, extra_args=(
                    "--no-warmup", "--key", str(self.clients / f"{rid}.key_secret"),
                    "--server-key", str(self.keydir / "server.key"),
                    "--auth", str(self.replica_keys))).start()
        wait_for(lambda: sorted((r["id"], r["agrees"]) for r in self.call("status")["replicas"])
                 == [("r1", True), ("r2", True)], what="both keyed replicas at the head")
        return self

    def stop(self) -> None:
        for r in self.replicas.values():
            r.stop()
        self.statesvc.stop()


@pytest.fixture(scope="module")
def auth_fleet(tmp_path_factory: pytest.TempPathFactory,
               example: ExampleAssets) -> Iterator[AuthFleet]:
    fleet = AuthFleet(tmp_path_factory.mktemp("auth-fleet"), example)
    try:
        yield fleet.start()
    finally:
        fleet.stop()


def test_replica_weights_and_process_details_are_for_operator_keys(
        auth_fleet: AuthFleet) -> None:
    app = auth_fleet.replica_call("r1", "status", "app")
    assert app["state"] == "ACTIVE"
    assert not {"pid", "argv", "cwd", "model"} & set(app)
    with pytest.raises(RemoteError) as refused:
        auth_fleet.replica_call("r1", "slot", "app", slot=0)
    assert refused.value.code == "forbidden" and "operator keys" in str(refused.value)
    ops = auth_fleet.replica_call("r1", "status", "alice")
    assert ops["model"] == str(auth_fleet.example.model_dir.resolve())
    assert not {"pid", "argv", "cwd"} & set(ops)  # the run file holds those, not the wire
    assert auth_fleet.replica_call("r1", "slot", "alice", slot=0)["rank"] > 0


def test_a_replicas_blobs_are_for_replica_and_operator_keys_and_replica_keys_get_no_more(
        auth_fleet: AuthFleet) -> None:
    fleet = auth_fleet
    sha = fleet.call("list")["adapters"][0]["sha256"]
    with pytest.raises(RemoteError) as refused:
        fleet.replica_call("r1", "blob", "app", sha256=sha)
    assert refused.value.code == "forbidden" and "replica and operator keys" in str(refused.value)
    assert hashlib.sha256(fleet.replica_call("r1", "blob", "alice", sha256=sha)["data"]
                          ).hexdigest() == sha
    # a peer replica's key, once the replica's key dir admits it under replicas/
    admitted = fleet.replica_keys / "replicas" / "r2.key"
    shutil.copy(fleet.clients / "r2.key", admitted)
    try:
        assert hashlib.sha256(fleet.replica_call("r1", "blob", "r2", sha256=sha)["data"]
                              ).hexdigest() == sha
        assert fleet.replica_call("r1", "status", "r2")["state"] == "ACTIVE"
        for cmd, args in [("slot", {"slot": 0}), ("generate", {"input_ids": [1, 2]}),
                          ("cancel", {"id": "x"})]:
            with pytest.raises(RemoteError) as refused:
                fleet.replica_call("r1", cmd, "r2", **args)
            assert refused.value.code == "forbidden", cmd
            assert "replica keys may only fetch blobs" in str(refused.value)
    finally:
        admitted.unlink()


def test_drill_passes_under_auth_and_a_spoofed_heartbeat_changes_nothing(
        auth_fleet: AuthFleet) -> None:
    fleet = auth_fleet
    # mallory holds a replica key: it may not heartbeat for r1, nor can a key-less peer connect
    with pytest.raises(RemoteError) as refused:
        fleet.call("heartbeat", "mallory", **beat("r1", "tcp://127.0.0.1:9"))
    assert refused.value.code == "forbidden"
    with ControlClient(fleet.statesvc.control, timeout_s=1, retries=0) as nobody:
        with pytest.raises(Unavailable):
            nobody.call("heartbeat", beat("r1", "tcp://127.0.0.1:9"))
    before = {r["id"]: r["address"] for r in fleet.call("status")["replicas"]}
    assert before == {rid: r.listen for rid, r in fleet.replicas.items()}
    run_file = fleet.replicas["r1"].cache_dir / runfile.RUN_FILE
    old = runfile.read(run_file)
    res = subprocess.run(
        [str(BIN / "loractl"), "--state", fleet.statesvc.control,
         "--key", str(fleet.clients / "alice.key_secret"),
         "--server-key", str(fleet.keydir / "server.key"),
         "drill", "--diffs", fleet.statesvc.publish, "--json", "--kill", "r1",
         "--run-file", str(run_file),
         "--replica-server-key", str(fleet.replica_keys / "server.key")],
        capture_output=True, text=True, timeout=280)
    new = runfile.read(run_file)
    try:
        assert res.returncode == 0, res.stderr
        report = json.loads(res.stdout)
        assert report["ok"] and {c["replica"] for c in report["checks"]} == {
            "r1", "r2", "drill-from-zero", "drill-from-snapshot"}
        assert new.pid != old.pid and new.argv == old.argv and not alive(old.pid)
        wait_for(lambda: [r["agrees"] for r in fleet.call("status")["replicas"]]
                 == [True, True], what="the restarted r1's heartbeat")
        assert {r["id"]: r["address"] for r in fleet.call("status")["replicas"]} == before
    finally:
        if new.pid != old.pid:  # the drill restarted r1: stop it by pid
            os.kill(new.pid, signal.SIGTERM)
            wait_for(lambda: not alive(new.pid), what="r1 stopped")
