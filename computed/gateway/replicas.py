"""One `generate` call to a replica, as the gateway makes it: a fresh DEALER that gives up at
once when the replica cannot be reached or drops the connection while the request runs (a
socket monitor reports the disconnect), so the gateway can try another replica instead of
waiting out the request timeout."""
from __future__ import annotations

import time
import uuid
from typing import Any

import zmq

from shared.client import RemoteError, Unavailable
from shared.config import MAX_WIRE_BYTES
from shared.endpoints import connect
from shared.keys import ClientKeys
from shared.protocol import ProtocolError, encode_request, unpack
from shared.replica_protocol import GENERATE


def generate(ctx: zmq.Context[Any], address: str, args: dict[str, Any], *,
             connect_timeout_s: float, timeout_s: float,
             keys: ClientKeys | None = None) -> dict[str, Any]:
    """The replica's result; RemoteError for its refusal, Unavailable when it cannot be
    reached within connect_timeout_s, goes away, or does not answer within timeout_s."""
    req_id = uuid.uuid4().hex
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_WIRE_BYTES)
    sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only to a connected peer
    sock.setsockopt(zmq.SNDTIMEO, int(connect_timeout_s * 1000))
    if keys is not None:
        keys.apply(sock)
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        connect(sock, address)
        try:
            sock.send(encode_request(req_id, GENERATE, args))
        except zmq.Again:
            raise Unavailable(f"no connection to {address} within {connect_timeout_s:g} s")
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            ready = dict(poller.poll(int(left * 1000) + 1))
            if monitor in ready:
                monitor.recv_multipart()
                raise Unavailable(f"{address} dropped the connection before answering")
            if sock not in ready:
                continue
            try:
                reply = unpack(sock.recv(), max_bytes=MAX_WIRE_BYTES)
            except ProtocolError:
                continue
            if not isinstance(reply, dict) or reply.get("id") != req_id:
                continue
            if reply.get("ok"):
                return dict(reply["result"])
            err = reply.get("error") or {}
            raise RemoteError(str(err.get("code")), str(err.get("message")), err.get("field"))
        raise Unavailable(f"no answer from {address} within {timeout_s:g} s")
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)
