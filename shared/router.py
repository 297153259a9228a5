"""The serving side of a ROUTER (statesvc's control socket, a replica's listen socket): the
socket's limits and the shape of a request.

A request is [routing id, body] (a DEALER) or [routing id, b"", body] (a REQ, or a DEALER
that adds REQ's delimiter); libzmq prepends the routing id and keeps it under 256 bytes. Any
other message is answered with one `bad_frame` error sent to the routing id alone, so nothing
else of it is kept or echoed: ZMQ_MAXMSGSIZE bounds each frame, not the number of frames.
"""
from __future__ import annotations

from typing import Any, Sequence

import zmq

from shared.config import MAX_QUEUED_REQUESTS, MAX_UNREAD_REPLIES, MAX_WIRE_BYTES
from shared.endpoints import Endpoint, bind
from shared.keys import ServerAuth
from shared.protocol import ProtocolError


def serving_router(ctx: zmq.Context[Any], endpoint: Endpoint,
                   auth: ServerAuth | None) -> tuple[zmq.Socket[Any], str]:
    """A ROUTER bound to `endpoint` with the per-connection limits; the bound address."""
    sock = ctx.socket(zmq.ROUTER)
    if auth is not None:
        auth.apply(sock)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_WIRE_BYTES)
    sock.setsockopt(zmq.SNDHWM, MAX_UNREAD_REPLIES)
    sock.setsockopt(zmq.RCVHWM, MAX_QUEUED_REQUESTS)
    sock.setsockopt(zmq.LINGER, 0)
    return sock, bind(sock, endpoint)


def split_request(frames: Sequence[zmq.Frame]) -> tuple[list[bytes], zmq.Frame]:
    """(envelope, body) of a message read with copy=False; ProtocolError (bad_frame) for any
    other shape, to be answered to `frames[:1]`."""
    if len(frames) == 2 or (len(frames) == 3 and len(frames[1]) == 0):
        return [f.bytes for f in frames[:-1]], frames[-1]
    raise ProtocolError("bad_frame", f"a request is one frame, after an empty delimiter frame "
                        f"at most (as REQ sends it); this message had {len(frames) - 1} frames")
