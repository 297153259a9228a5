"""A replica reads statesvc's diff stream through schemas: a malformed heartbeat or diff is
dropped with a warning, and the sync loop keeps following (real PUB and SUB sockets)."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import zmq

from computed.sync import SyncLoop
from computed.replica import Phase, Replica
from shared.client import ControlClient
from shared.fingerprint import read_model
from shared.protocol import pack
from statesvc.tools.example import ExampleAssets
from testkit.fleet import loopback

LOG_ID = "0b7e4f9e-3c1a-4f7e-9a52-1f0c2d3e4b5a"


def heartbeat(head: Any, **extra: Any) -> list[bytes]:
    return [b"hb", pack({"head_seq": head, "digest": "0" * 64, "ts": 1.0, "log_id": LOG_ID,
                         **extra})]


def test_malformed_heartbeats_and_diffs_are_dropped(tmp_path: Path, example: ExampleAssets,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    ctx = zmq.Context.instance()
    pub, sub = ctx.socket(zmq.PUB), ctx.socket(zmq.SUB)
    client = ControlClient(loopback(), timeout_s=0.1, retries=0)  # never called here
    try:
        for s in (pub, sub):
            s.setsockopt(zmq.LINGER, 0)
        address = loopback()
        pub.bind(address)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(address)
        replica = Replica(read_model(example.model_dir), client, tmp_path / "cache")
        loop = SyncLoop(replica, replica_id="r", listen=loopback(), state=client.address,
                        diffs=address, heartbeat=False)
        loop.sub = sub

        def drain_until(head: int) -> None:
            for _ in range(200):
                if sub.poll(50):
                    loop._drain_sub()
                if loop.remote_head == head:
                    return
                if head == 1:  # the subscription takes effect asynchronously: probe again
                    pub.send_multipart(heartbeat(1))
            raise AssertionError(f"heartbeat {head} never arrived")

        pub.send_multipart(heartbeat(1))
        drain_until(1)
        bad = [heartbeat(math.inf), heartbeat(2**64 - 1), heartbeat(-1), heartbeat("7"),
               heartbeat(True), heartbeat(3, log_id="not-a-uuid"), heartbeat(3, extra=1),
               [b"hb", pack([1, 2])], [b"hb", b"\xc1"],
               [b"diff", pack({"seq": math.inf, "op": "unload", "log_id": LOG_ID, "name": "a",
                               "version": 1, "slot": 0})],
               [b"diff", pack({"seq": 2, "op": "unload", "log_id": LOG_ID, "name": "a",
                               "version": math.inf, "slot": 0})],
               [b"diff", pack({"seq": 2, "op": "unload", "log_id": 5, "name": "a",
                               "version": 1, "slot": 0})],
               [b"diff", pack({"seq": 2.0, "op": "configure", "pool": {}})]]
        for frames in bad:
            pub.send_multipart(frames)
        pub.send_multipart(heartbeat(5))
        drain_until(5)  # every bad message before it was dropped, none raised
        assert loop.queue == {} and replica.applied_seq == 0 and replica.pool is None
        assert replica.phase is Phase.INITIAL and replica.last_error is None
        dropped = [r for r in caplog.records if "dropped a malformed" in r.getMessage()]
        assert len(dropped) == len(bad)
    finally:
        client.close()
        pub.close(0)
        sub.close(0)
