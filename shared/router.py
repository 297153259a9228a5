"""The serving side of a ROUTER (statesvc's control socket, a replica's listen socket): the
socket's limits, the shape of a request, and how replies go out.

A request is [routing id, body] (a DEALER) or [routing id, b"", body] (a REQ, or a DEALER
that adds REQ's delimiter); libzmq prepends the routing id and keeps it under 256 bytes. Any
other message is answered with one `bad_frame` error sent to the routing id alone, so nothing
else of it is kept or echoed: ZMQ_MAXMSGSIZE bounds each frame, not the number of frames.

libzmq keeps at most MAX_UNREAD_REPLIES replies per connection (ZMQ_SNDHWM) and, as a ROUTER,
drops what does not fit. A service answers a batch in a burst faster than libzmq's I/O thread
moves replies to the kernel, so `Replies` holds what does not fit yet (ZMQ_ROUTER_MANDATORY
says so) and offers it again, up to MAX_HELD_REPLY_BYTES per connection: a connection that
reads its replies loses none, one that does not costs a bounded amount.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Sequence

import zmq

from shared.config import (MAX_HELD_REPLY_BYTES, MAX_QUEUED_REQUESTS, MAX_UNREAD_REPLIES,
                           MAX_WIRE_BYTES)
from shared.endpoints import Endpoint, bind
from shared.keys import ServerAuth
from shared.protocol import ProtocolError

Part = bytes | zmq.Frame  # one frame of a reply


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
    try:
        return sock, bind(sock, endpoint)
    except BaseException:  # BindError: nothing is left open behind it
        sock.close(0)
        raise


def split_request(frames: Sequence[zmq.Frame]) -> tuple[list[bytes], zmq.Frame]:
    """(envelope, body) of a message read with copy=False; ProtocolError (bad_frame) for any
    other shape, to be answered to `frames[:1]`."""
    if len(frames) == 2 or (len(frames) == 3 and len(frames[1]) == 0):
        return [f.bytes for f in frames[:-1]], frames[-1]
    raise ProtocolError("bad_frame", f"a request is one frame, after an empty delimiter frame "
                        f"at most (as REQ sends it); this message had {len(frames) - 1} frames")


class Replies:
    """Replies on a serving ROUTER, in order per connection, never blocking the service."""

    def __init__(self, sock: zmq.Socket[Any]) -> None:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full queue raises instead of dropping
        self.sock = sock
        self.held: dict[bytes, deque[Sequence[Part]]] = {}
        self.held_bytes: dict[bytes, int] = {}

    def send(self, frames: Sequence[Part]) -> None:
        """Send `frames` ([routing id, ..., reply]) now, or hold it behind the connection's
        earlier ones; drop it when that connection already has MAX_HELD_REPLY_BYTES held.
        Nothing is copied: a bytes reply is handed to libzmq as it is, a received Frame
        (a blob chunk from statesvc's blob thread) is forwarded as it is."""
        peer = frames[0] if isinstance(frames[0], bytes) else frames[0].bytes
        if peer not in self.held and self._offer(frames):
            return
        held = self.held_bytes.get(peer, 0)
        size = sum(map(len, frames))
        if held and held + size > MAX_HELD_REPLY_BYTES:
            return  # the peer does not read its replies: it sees silence, as for a lost one
        self.held.setdefault(peer, deque()).append(frames)
        self.held_bytes[peer] = held + size

    def flush(self) -> None:
        """Offer the held replies to libzmq again."""
        for peer in list(self.held):
            queue = self.held[peer]
            while queue and self._offer(queue[0]):
                self.held_bytes[peer] -= sum(map(len, queue.popleft()))
            if not queue:
                del self.held[peer], self.held_bytes[peer]

    def _offer(self, frames: Sequence[Part]) -> bool:
        """True when libzmq took the reply, or its connection is gone."""
        try:
            self.sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
        return True
