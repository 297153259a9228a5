"""Replicas fetching blobs from each other (issue 18): a replica that bootstraps or catches up
asks the replicas that applied each event before statesvc, checks every byte against the
sha256, and falls back to statesvc when a peer has nothing or sends other bytes. Real
statesvc and replicas as subprocesses on loopback, pool-only."""
from __future__ import annotations

import hashlib
import threading
from typing import Any, Iterator

import pytest
import zmq

from shared.client import ControlClient, RemoteError
from shared.protocol import ok_reply, unpack
from testkit.fleet import Computed, loopback, wait_for
from tests.helpers import Fleet

POOL_ONLY = ("--no-warmup", "--no-inference")


def _sha(fleet: Fleet, adapter: str) -> str:
    return hashlib.sha256((fleet.example.adapter_dirs[adapter]
                           / "adapter_model.safetensors").read_bytes()).hexdigest()


def _settled(fleet: Fleet, *replicas: Computed) -> None:
    """Each replica at the head, and statesvc's registry saying so (what peers are picked by)."""
    wait_for(lambda: fleet.converged(*replicas), what="replicas at the head")
    head, ids = fleet.head(), {r.replica_id for r in replicas}
    with fleet.client() as c:
        wait_for(lambda: {r["id"] for r in c.call("status")["replicas"]
                          if r["applied_seq"] == head and r["state"] == "ACTIVE"} >= ids,
                 what="their heartbeats at the head")


def _digests(status: dict[str, Any]) -> tuple[str, str]:
    return status["logical_digest"], status["pool_digest"]


def test_a_new_replica_takes_its_blobs_from_a_peer_not_statesvc(fleet: Fleet) -> None:
    fleet.init()
    fleet.load("a", "attn-qv-r8")
    fleet.load("b", "mlp-only-r16")
    r1 = fleet.replica("r1", args=POOL_ONLY)
    _settled(fleet, r1)
    assert r1.status()["blob_fetches"] == 2  # the first replica has no peer
    r2 = fleet.replica("r2", args=POOL_ONLY)
    wait_for(lambda: fleet.converged(r2), what="r2 bootstrapped")
    s1, s2 = r1.status(), r2.status()
    assert (s2["blob_fetches"], s2["peer_blob_fetches"]) == (0, 2)
    assert _digests(s2) == _digests(s1) and s2["last_error"] is None
    # the live tail still comes from statesvc: no peer holds it yet
    fleet.load("c", "all-r2")
    wait_for(lambda: fleet.converged(r1, r2), what="the live load")
    assert r2.status()["blob_fetches"] == 1
    assert _digests(r2.status()) == _digests(r1.status())


def test_a_peer_with_other_bytes_is_passed_over_for_statesvc(fleet: Fleet) -> None:
    fleet.init()
    fleet.load("a", "attn-qv-r8")
    r1 = fleet.replica("r1", args=POOL_ONLY)
    _settled(fleet, r1)
    cached = r1.cache_dir / "blobs" / _sha(fleet, "attn-qv-r8")
    wait_for(cached.is_file, what="r1's cache writer")  # written after the slot, off the sync thread
    good = cached.read_bytes()
    cached.write_bytes(bytes([good[0] ^ 1]) + good[1:])  # r1 serves what it has, unchecked
    r2 = fleet.replica("r2", args=POOL_ONLY)
    wait_for(lambda: fleet.converged(r2), what="r2 despite its peer's bad bytes")
    s2 = r2.status()
    assert (s2["blob_fetches"], s2["peer_blob_fetches"]) == (1, 0)
    assert s2["last_error"] is None
    assert "hashes to" in r2.log.read_text()  # why the peer was passed over
    # what r2 now holds is statesvc's bytes: it serves them to the next one
    r3 = fleet.replica("r3", args=POOL_ONLY)
    wait_for(lambda: fleet.converged(r3), what="r3")
    assert _digests(r3.status()) == _digests(r2.status())
    assert r3.status()["blob_fetches"] + r3.status()["peer_blob_fetches"] == 1


def test_a_replica_serves_only_blobs_it_holds_and_only_what_they_hold(fleet: Fleet) -> None:
    fleet.init()
    fleet.load("a", "attn-qv-r8")
    r1 = fleet.replica("r1", args=POOL_ONLY)
    _settled(fleet, r1)
    sha = _sha(fleet, "attn-qv-r8")
    data = (fleet.example.adapter_dirs["attn-qv-r8"] / "adapter_model.safetensors").read_bytes()
    with ControlClient(r1.listen, timeout_s=10, retries=0) as c:
        whole = c.call("blob", {"sha256": sha})
        assert (whole["size"], whole["data"]) == (len(data), data)
        part = c.call("blob", {"sha256": sha, "offset": 100, "length": 50})
        assert part["data"] == data[100:150]
        for args, code in [({"sha256": "0" * 64}, "not_found"),
                           ({"sha256": "../" + "0" * 61}, "bad_request"),
                           ({"sha256": sha, "offset": len(data) + 1}, "bad_request"),
                           ({"sha256": sha, "length": 0}, "bad_request")]:
            with pytest.raises(RemoteError) as refused:
                c.call("blob", args)
            assert refused.value.code == code, args
        assert c.call("status")["state"] == "ACTIVE"  # and it keeps serving


@pytest.fixture
def liar() -> Iterator[str]:
    """A peer on a real ROUTER socket that answers every `blob` with a chunk of a blob far
    larger than any adapter (a replica key gone bad): its address."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    address = loopback()
    sock.bind(address)
    done = threading.Event()

    def answer() -> None:
        while not done.is_set():
            if not sock.poll(50):
                continue
            *envelope, body = sock.recv_multipart()
            req = unpack(body)
            sock.send_multipart([*envelope, ok_reply(req["id"], {
                "sha256": req["args"]["sha256"], "offset": req["args"].get("offset", 0),
                "size": 1 << 40, "data": b"\0" * 1024})])

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        yield address
    finally:
        done.set()
        thread.join(5)
        sock.close(0)


def test_a_peer_that_claims_another_size_is_passed_over(fleet: Fleet, liar: str) -> None:
    """What a peer sends is bounded by the event's size: a peer that says 1 TiB is refused at
    its first chunk, and statesvc serves the blob."""
    fleet.init()
    fleet.load("a", "attn-qv-r8")
    head = fleet.head()
    with fleet.client() as c:  # the liar registers as an ACTIVE replica at the head
        c.call("heartbeat", {"id": "liar", "address": liar, "state": "ACTIVE",
                             "applied_seq": head, "logical_digest": "0" * 64,
                             "pool_digest": "none"})
    r1 = fleet.replica("r1", args=POOL_ONLY)
    wait_for(lambda: fleet.converged(r1), what="r1 despite the liar")
    s1 = r1.status()
    assert (s1["blob_fetches"], s1["peer_blob_fetches"], s1["last_error"]) == (1, 0, None)
    assert "not the blob's next chunk" in r1.log.read_text()
