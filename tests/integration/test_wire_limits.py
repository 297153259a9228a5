"""Addresses and memory bounds on the wire, through the real CLIs and real services.

- Without --auth, `statesvc serve` and `computed serve --listen` bind one plain loopback
  endpoint or refuse to start, saying what is wrong and what to do; malformed addresses to
  connect to are usage errors, not libzmq tracebacks.
- A request is [routing id, (empty delimiter), body]: any other message gets one error reply
  and none of its frames back, from statesvc and from a replica.
- A client that asks for many blob chunks and reads no reply costs statesvc memory bounded
  by the per-connection limits, not by how many it asked for; one that pipelines many
  requests and reads its replies loses none.
- A replica's per-client queue limit counts CURVE identities, not connections.
"""
from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any, Iterator

import pytest
import zmq

from shared.client import ControlClient, RemoteError, new_event_id
from shared.config import MAX_BLOB_CHUNK, MAX_HELD_REPLY_BYTES, MAX_UNREAD_REPLIES
from shared.keys import ClientKeys, client_keys
from shared.protocol import encode_request, pack, unpack
from shared.blobserve import IN_FLIGHT
from statesvc.tools.example import ExampleAssets
from testkit.fleet import Computed, StateSvc, free_port, memory_kb, wait_for
from tests.helpers import dealer, make_keys, run, usage

pytestmark = pytest.mark.timeout(240)

REPLY_WAIT_MS = 20_000  # a generous wait for a reply that must come; nothing asserts on time


# ---- endpoints -----------------------------------------------------------------------------

# (address, what the refusal must say); {p} and {q} are free ports
NOT_LOOPBACK = {
    "source;bind": ("tcp://127.0.0.1:{p};0.0.0.0:{q}", "has a ';'"),
    "0.0.0.0": ("tcp://0.0.0.0:{p}", "0.0.0.0 binds every interface"),
    "*": ("tcp://*:{p}", "* binds every interface"),
    "[::]": ("tcp://[::]:{p}", ":: binds every interface"),
    "lo": ("tcp://lo:{p}", "lo is an interface name"),
    "eth0": ("tcp://eth0:{p}", "eth0 is an interface name"),
    "routable": ("tcp://10.1.2.3:{p}", "10.1.2.3 is not loopback"),
    "trailing path": ("tcp://127.0.0.1:{p}/x", "is not HOST:PORT"),
    "trailing space": ("tcp://127.0.0.1:{p} ", "is not HOST:PORT"),
    "short ipv4": ("tcp://127.1:{p}", "is not an IPv4 address"),
    "port range": ("tcp://127.0.0.1:70000", "port must be between 0 and 65535"),
    "no scheme": ("127.0.0.1:{p}", "is not a tcp:// or ipc:// address"),
    "inproc": ("inproc://control", "is not a tcp:// or ipc:// address"),
}


def _address(template: str) -> str:
    return template.format(p=free_port(), q=free_port())


def assert_refused(res: subprocess.CompletedProcess[str], flag: str, says: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stderr)  # a usage error
    assert flag in res.stderr and says in res.stderr, res.stderr
    assert "Traceback" not in res.stderr, res.stderr


# Every case through the command's own click parsing in this process (tests/helpers.py `usage`:
# a process start is most of a refusal's time, docs/testing.md); the installed commands
# themselves, as processes, refuse one case each (`test_the_installed_commands_refuse_...`).
@pytest.mark.parametrize("case", NOT_LOOPBACK)
def test_statesvc_binds_only_plain_loopback_without_auth(tmp_path: Path, case: str) -> None:
    template, says = NOT_LOOPBACK[case]
    data = tmp_path / "data"
    res = usage("statesvc", "serve", "--data-dir", str(data), "--control", _address(template),
                "--publish", f"tcp://127.0.0.1:{free_port()}")
    assert_refused(res, "--control", says)
    if "not loopback" in says or "every interface" in says or "interface name" in says:
        assert "bind loopback" in res.stderr and "--auth DIR" in res.stderr, res.stderr
    assert not (data / "state.db").exists()  # refused before the log is touched
    res = usage("statesvc", "serve", "--data-dir", str(data), "--control",
                f"tcp://127.0.0.1:{free_port()}", "--publish", _address(template))
    assert_refused(res, "--publish", says)


REPLICA_CASES = ["source;bind", "0.0.0.0", "*", "[::]", "lo", "eth0", "trailing path"]


def _serve_listening(example: ExampleAssets, tmp_path: Path, template: str) -> tuple[str, ...]:
    return ("computed", "serve", "--model", str(example.model_dir), "--listen", _address(template),
            "--cache-dir", str(tmp_path / "cache"), "--no-warmup")


@pytest.mark.parametrize("case", REPLICA_CASES)
def test_replica_listens_only_on_plain_loopback_without_auth(
        tmp_path: Path, example: ExampleAssets, case: str) -> None:
    template, says = NOT_LOOPBACK[case]
    assert_refused(usage(*_serve_listening(example, tmp_path, template)), "--listen", says)


def test_the_installed_commands_refuse_a_bind_beyond_loopback_as_processes(
        tmp_path: Path, example: ExampleAssets) -> None:
    """The entry points themselves (.venv/bin), not only their click commands: exit 2, the flag
    and the reason on stderr, no traceback, nothing written."""
    template, says = NOT_LOOPBACK["routable"]
    data = tmp_path / "data"
    res = run("statesvc", "serve", "--data-dir", str(data), "--control", _address(template),
              "--publish", f"tcp://127.0.0.1:{free_port()}")
    assert_refused(res, "--control", says)
    assert "bind loopback" in res.stderr and "--auth DIR" in res.stderr, res.stderr
    assert not (data / "state.db").exists()
    template, says = NOT_LOOPBACK["0.0.0.0"]
    assert_refused(run(*_serve_listening(example, tmp_path, template)), "--listen", says)


@pytest.mark.parametrize("argv, flag", [
    (("loractl", "--state", "tcp://127.0.0.1:7100;10.0.0.1:7100", "list"), "--state"),
    (("loractl", "--state", "tcp://127.0.0.1", "list"), "--state"),
    (("loractl", "--state", "tcp://127.0.0.1:0", "list"), "--state"),
    (("loractl", "events", "--follow", "--diffs", "tcp://[::1:7101"), "--diffs"),
    (("loractl", "generate", "--replica", "tcp://host name:7200", "--input-ids", "1"),
     "--replica"),
    (("computed", "serve", "--model", ".", "--state", "udp://127.0.0.1:7100"), "--state"),
    (("computed", "serve", "--model", ".", "--diffs", "tcp://127.0.0.1:7101 x"), "--diffs"),
])
def test_malformed_connect_addresses_are_usage_errors(argv: tuple[str, ...], flag: str) -> None:
    res = usage(*argv)
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert f"Invalid value for '{flag}'" in res.stderr and "Traceback" not in res.stderr, \
        res.stderr


def test_loopback_forms_and_authenticated_wildcards_start(tmp_path: Path,
                                                         example: ExampleAssets) -> None:
    """localhost, [::1] and ipc:// start without --auth (and clients reach them); with --auth
    a wildcard bind is allowed."""
    port = free_port()
    svc = StateSvc(tmp_path / "a", control=f"tcp://[::1]:{port}",
                   publish=f"ipc://{tmp_path}/diffs.sock")
    other = StateSvc(tmp_path / "b", control=f"tcp://localhost:{free_port()}")
    keydir = tmp_path / "keys"
    assert run("statesvc", "keys", "init", str(keydir)).returncode == 0
    keyed = StateSvc(tmp_path / "c", control=f"tcp://*:{free_port()}",
                     publish=f"tcp://0.0.0.0:{free_port()}", extra_args=("--auth", str(keydir)))
    replica = Computed(example.model_dir, svc, tmp_path / "replicas" / "r", replica_id="r",
                       listen=f"tcp://[::1]:{free_port()}",
                       extra_args=("--no-warmup", "--no-inference"))
    try:
        for s in (svc, other, keyed):
            s.start()
        for s in (svc, other):
            with ControlClient(s.control, timeout_s=20, retries=0) as c:
                assert c.call("status")["head_seq"] == 0
        res = run("loractl", "--state", svc.control, "status", "--json")
        assert res.returncode == 0, res.stderr
        replica.start()
        assert replica.status()["id"] == "r"
    finally:
        replica.stop()
        for s in (svc, other, keyed):
            s.stop()


def test_heartbeat_with_a_malformed_address_is_refused(statesvc: StateSvc) -> None:
    """A replica's address is what the drill and `loractl status` connect to: statesvc takes
    only one it could connect to."""
    beat = {"id": "r", "state": "ACTIVE", "applied_seq": 0, "logical_digest": "0" * 64,
            "pool_digest": "none"}
    with ControlClient(statesvc.control, timeout_s=20, retries=0) as c:
        for address in ("tcp://127.0.0.1:1;10.0.0.1:2", "not an address", "tcp://[::1:7200"):
            with pytest.raises(RemoteError) as refused:
                c.call("heartbeat", {**beat, "address": address})
            assert (refused.value.code, refused.value.field) == ("bad_request", "args.address")
        assert c.call("status")["replicas"] == []
        c.call("heartbeat", {**beat, "address": "tcp://[::1]:7200"})
        assert [r["address"] for r in c.call("status")["replicas"]] == ["tcp://[::1]:7200"]


# ---- whole messages ------------------------------------------------------------------------

GOOD = pack({"v": 1, "id": "good", "cmd": "status"})
# messages that are not [body] or ["", body] from a DEALER (the ROUTER adds the routing id)
BAD_SHAPES = {
    "junk envelope frame": [b"\x01" * (4 << 20), GOOD],
    "two delimiters": [b"", b"", GOOD],
    "good request, then junk": [GOOD, b"\xc1 junk"],
    "many frames": [b"x" * (1 << 20)] * 20 + [GOOD],
}


def assert_not_echoed(sock: zmq.Socket[Any], frames: list[bytes]) -> None:
    """`frames` get one bad_frame reply, alone: none of what was sent comes back."""
    sock.send_multipart(frames)
    assert sock.poll(REPLY_WAIT_MS), "no reply"
    parts = sock.recv_multipart()
    assert len(parts) == 1, [len(p) for p in parts]
    reply = unpack(parts[0])
    assert reply["ok"] is False and reply["error"]["code"] == "bad_frame", reply
    assert "one frame" in reply["error"]["message"], reply


def assert_answers(sock: zmq.Socket[Any], envelope: list[bytes]) -> dict[str, Any]:
    sock.send_multipart([*envelope, GOOD])
    assert sock.poll(REPLY_WAIT_MS), "no reply"
    parts = sock.recv_multipart()
    assert parts[:-1] == envelope
    reply = unpack(parts[-1])
    assert reply["ok"] is True and reply["id"] == "good", reply
    return dict(reply["result"])



def test_statesvc_never_echoes_extra_frames(statesvc: StateSvc) -> None:
    sock = dealer(statesvc.control)
    try:
        for name, frames in BAD_SHAPES.items():
            assert_not_echoed(sock, frames)
            assert_answers(sock, [])
        assert_answers(sock, [b""])  # REQ's delimiter is the one envelope frame allowed
    finally:
        sock.close(0)
    assert statesvc.proc is not None and statesvc.proc.poll() is None


def test_a_burst_of_pipelined_requests_is_answered_in_full(statesvc: StateSvc) -> None:
    """Far more replies than libzmq keeps per connection (a batch answers them at once): the
    service holds the rest until they fit, so a client that reads loses none."""
    sock = dealer(statesvc.control)
    asks = 1000
    try:
        for i in range(asks):
            sock.send(encode_request(f"s{i}", "status", {}))
        ids = []
        while len(ids) < asks:
            assert sock.poll(REPLY_WAIT_MS), f"{len(ids)} of {asks} replies came"
            ids.append(unpack(sock.recv())["id"])
    finally:
        sock.close(0)
    assert ids == [f"s{i}" for i in range(asks)]


def test_unread_blob_replies_cost_bounded_memory(statesvc: StateSvc,
                                                example: ExampleAssets) -> None:
    """A client asks for the same blob N times and reads nothing: statesvc's peak RSS grows by
    what the limits allow (replies libzmq keeps and statesvc holds per connection, the blob
    thread's replies in flight), not by N replies."""
    assert statesvc.proc is not None
    pid = statesvc.proc.pid
    ctx = zmq.Context.instance()
    with ControlClient(statesvc.control, timeout_s=20, retries=0) as c:
        c.call("pool.init", {"event_id": new_event_id(), "model": str(example.model_dir),
                             "max_loras": 4, "max_rank": 32, "targets": "all"})
        c.call("load", {"event_id": new_event_id(), "name": "big",
                                 "path": str(example.adapter_dirs["all-r32-rslora"])})
        sha = c.call("list")["adapters"][0]["sha256"]
        reply_bytes = len(c.call("blob", {"sha256": sha})["data"])  # once, as a replica would
    assert reply_bytes > 200_000
    baseline = memory_kb(pid, "VmHWM") * 1024
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(statesvc.publish)
    assert sub.poll(REPLY_WAIT_MS), "no heartbeat"  # subscribed
    greedy = dealer(statesvc.control)
    asks = 1600
    try:
        for i in range(asks):
            greedy.send(encode_request(f"b{i}", "blob", {"sha256": sha}))
        # a write after them, on the same connection: statesvc reads a connection's requests
        # in order, so its diff says every blob request before it was handed to the blob thread
        greedy.send(encode_request("last", "load", {
            "event_id": new_event_id(), "name": "last",
            "path": str(example.adapter_dirs["attn-qv-r8"])}))
        while True:
            assert sub.poll(120_000), "statesvc published nothing for the last request"
            topic, body = sub.recv_multipart()
            if topic == b"diff" and unpack(body)["name"] == "last":
                break
        with ControlClient(statesvc.control, timeout_s=120, retries=0) as c:
            def read_once() -> bool:  # the blob thread is FIFO: then every earlier one was read
                try:
                    return bool(c.call("blob", {"sha256": sha}))
                except RemoteError as exc:  # its queue is full of the greedy client's reads
                    assert exc.code == "overloaded", exc
                    return False

            wait_for(read_once, timeout=300, what="a blob read behind the greedy ones")
        grew = memory_kb(pid, "VmHWM") * 1024 - baseline
    finally:
        greedy.close(0)
        sub.close(0)
    allowed = ((MAX_UNREAD_REPLIES + 2) * reply_bytes  # in libzmq's queue, being written
               + MAX_HELD_REPLY_BYTES + reply_bytes  # held by the service for the connection
               + 2 * IN_FLIGHT * MAX_BLOB_CHUNK  # the blob thread's replies: read, then packed
               + (32 << 20))  # the interpreter's own churn
    assert asks * reply_bytes > 3 * allowed  # what the test would see without the bound
    assert grew <= allowed, (f"statesvc's peak RSS grew {grew >> 20} MiB for {asks} unread "
                             f"replies of {reply_bytes >> 10} KiB; allowed {allowed >> 20} MiB")
    assert statesvc.proc.poll() is None


# ---- a replica: its envelope and its clients -----------------------------------------------


@pytest.fixture
def keyed_replica(tmp_path: Path, example: ExampleAssets
                  ) -> Iterator[tuple[Computed, dict[str, ClientKeys]]]:
    """A replica with CURVE on its listen socket, holding requests in its queue (min_seq far
    ahead) so that they count against the per-client limit of 2; keys: app, other."""
    keydir, clients = make_keys(tmp_path, {"app": "clients", "other": "clients"})
    keys: dict[str, ClientKeys] = {}
    for name in ("app", "other"):
        k = client_keys(str(clients / f"{name}.key_secret"), str(keydir / "server.key"))
        assert k is not None
        keys[name] = k
    svc = StateSvc(tmp_path / "data").start()
    replica = Computed(example.model_dir, svc, tmp_path / "replicas" / "r", replica_id="r",
                       extra_args=("--no-warmup", "--max-len", "64", "--auth", str(keydir),
                                   "--client-queue-limit", "2", "--min-seq-timeout", "600"))
    try:
        replica.start()
        yield replica, keys
    finally:
        replica.stop()
        svc.stop()


def test_replica_never_echoes_extra_frames(
        keyed_replica: tuple[Computed, dict[str, ClientKeys]]) -> None:
    replica, keys = keyed_replica
    sock = dealer(replica.listen, keys=keys["app"])
    try:
        for name, frames in BAD_SHAPES.items():
            assert_not_echoed(sock, [*frames[:-1], pack({"v": 1, "id": "g", "cmd": "generate",
                                                         "args": {"input_ids": [1]}})])
            assert assert_answers(sock, [])["id"] == "r"
        assert assert_answers(sock, [b""])["inference"]["waiting"] == 0  # nothing was queued
    finally:
        sock.close(0)


def test_client_queue_limit_counts_keys_not_connections(
        keyed_replica: tuple[Computed, dict[str, ClientKeys]]) -> None:
    replica, keys = keyed_replica
    waits = {"input_ids": [1, 2], "max_new_tokens": 1, "min_seq": 1 << 40}
    socks = [dealer(replica.listen, keys=keys[k]) for k in ("app", "app", "app", "other")]
    watch = dealer(replica.listen, keys=keys["other"])
    try:
        for i, sock in enumerate(socks):
            sock.send(encode_request(f"g{i}", "generate", waits))
            if i == 2:  # app's third request, on its third connection: over its limit of 2
                assert sock.poll(REPLY_WAIT_MS), "no reply to the request over the limit"
                reply = unpack(sock.recv())
                assert reply["id"] == "g2" and reply["error"]["code"] == "overloaded", reply
                assert "per-client limit is 2" in reply["error"]["message"], reply
            else:  # queued: it waits for min_seq
                want = min(i, 2) + 1
                wait_for(lambda: assert_answers(watch, [])["inference"]["waiting"] == want,
                         what=f"request g{i} to be queued")
        assert not any(s.poll(0) for s in (socks[0], socks[1], socks[3]))
    finally:
        for sock in [*socks, watch]:
            sock.close(0)
