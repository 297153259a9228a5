"""`generate` calls to replicas, as the gateway makes them: each on a DEALER that gives up at
once when the replica cannot be reached or drops the connection while the request runs (a
socket monitor reports the disconnect), so the gateway can try another replica instead of
waiting out the request timeout. Connected sockets are kept per replica and reused, one
request at a time each, so a request does not pay for a TCP connection and handshake."""
from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import zmq

from shared.client import RemoteError, Unavailable
from shared.config import MAX_WIRE_BYTES
from shared.endpoints import connect
from shared.keys import ClientKeys
from shared.protocol import ProtocolError, encode_request, unpack
from shared.replica_protocol import GENERATE

MAX_IDLE_PER_REPLICA = 64


@dataclass
class _Link:
    sock: zmq.Socket[Any]
    monitor: zmq.Socket[Any]

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close(0)


class ReplicaLinks:
    """Idle connected sockets per replica address; a socket is used by one thread at a time."""

    def __init__(self, ctx: zmq.Context[Any], keys: ClientKeys | None = None) -> None:
        self.ctx, self.keys = ctx, keys
        self._idle: dict[str, list[_Link]] = {}
        self._lock = threading.Lock()

    def _take(self, address: str) -> _Link:
        with self._lock:
            idle = self._idle.get(address, [])
            while idle:
                link = idle.pop()
                if not link.monitor.poll(0):  # no disconnect since it was last used
                    return link
                link.close()
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_WIRE_BYTES)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only to a connected peer
        if self.keys is not None:
            self.keys.apply(sock)
        link = _Link(sock, sock.get_monitor_socket(zmq.EVENT_DISCONNECTED))
        connect(sock, address)
        return link

    def _give_back(self, address: str, link: _Link) -> None:
        with self._lock:
            idle = self._idle.setdefault(address, [])
            if len(idle) < MAX_IDLE_PER_REPLICA:
                idle.append(link)
                return
        link.close()

    def generate(self, address: str, args: dict[str, Any], *, connect_timeout_s: float,
                 timeout_s: float, on_token: Callable[[int], None] | None = None
                 ) -> dict[str, Any]:
        """The replica's result; RemoteError for its refusal, Unavailable when it cannot be
        reached within connect_timeout_s, goes away, or does not answer within timeout_s.
        With `on_token`, the request streams: each token is passed to it as it arrives."""
        link = self._take(address)
        try:
            result = self._call(link, address, args, connect_timeout_s, timeout_s, on_token)
        except RemoteError:
            self._give_back(address, link)
            raise
        except BaseException:
            link.close()  # a reply may still come for this request: never reuse the socket
            raise
        self._give_back(address, link)
        return result

    @staticmethod
    def _call(link: _Link, address: str, args: dict[str, Any], connect_timeout_s: float,
              timeout_s: float, on_token: Callable[[int], None] | None) -> dict[str, Any]:
        req_id = uuid.uuid4().hex
        link.sock.setsockopt(zmq.SNDTIMEO, int(connect_timeout_s * 1000))
        if on_token is not None:
            args = {**args, "stream": True}
        streamed = 0
        try:
            link.sock.send(encode_request(req_id, GENERATE, args))
        except zmq.Again:
            raise Unavailable(f"no connection to {address} within {connect_timeout_s:g} s")
        poller = zmq.Poller()
        poller.register(link.sock, zmq.POLLIN)
        poller.register(link.monitor, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            ready = dict(poller.poll(int(left * 1000) + 1))
            if link.monitor in ready:
                raise Unavailable(f"{address} dropped the connection before answering")
            if link.sock not in ready:
                continue
            try:
                reply = unpack(link.sock.recv(), max_bytes=MAX_WIRE_BYTES)
            except ProtocolError:
                continue
            if not isinstance(reply, dict) or reply.get("id") != req_id:
                continue
            token = reply.get("token")
            if on_token is not None and reply.get("ok") and isinstance(token, dict):
                if token.get("index") == streamed and type(token.get("id")) is int:
                    streamed += 1
                    on_token(token["id"])
                continue
            if reply.get("ok"):
                return dict(reply["result"])
            err = reply.get("error") or {}
            raise RemoteError(str(err.get("code")), str(err.get("message")), err.get("field"))
        raise Unavailable(f"no answer from {address} within {timeout_s:g} s")
