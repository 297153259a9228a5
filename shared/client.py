"""A control-socket client: one request, one reply, retried on silence.

Writes carry a client-chosen event_id, so resending after a timeout is safe:
the state service records the command once and answers a retry with the
original result (the ZeroMQ Guide's Lazy Pirate pattern).
"""
from __future__ import annotations

import threading
import uuid
from typing import Any, Mapping

import zmq

from shared.config import MAX_LIST_PAGE, MAX_WIRE_BYTES
from shared.endpoints import connect
from shared.errors import CodedError
from shared.keys import ClientKeys
from shared.protocol import ProtocolError, encode_request, unpack


class RemoteError(CodedError):
    """The service answered with an error."""


class Unavailable(Exception):
    """No answer within the timeout, after the retries."""


class ControlClient:
    def __init__(self, address: str, *, timeout_s: float = 10.0, retries: int = 2,
                 context: zmq.Context[Any] | None = None, keys: ClientKeys | None = None) -> None:
        self.address = address
        self.keys = keys
        self.timeout_ms = int(timeout_s * 1000)
        self.retries = retries
        self.ctx = context or zmq.Context.instance()
        self.sock: zmq.Socket[Any] | None = None
        # one request at a time: a replica's sync thread and its engine (filling a slot on a
        # miss) share one client, and a ZeroMQ socket is not thread-safe
        self._calling = threading.Lock()

    def _socket(self) -> zmq.Socket[Any]:
        if self.sock is None:
            self.sock = self.ctx.socket(zmq.DEALER)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_WIRE_BYTES)
            # queue a request only to a connected peer, and wait for one at most the timeout: a
            # send with no peer (none listening, or a refused CURVE handshake) would block forever
            self.sock.setsockopt(zmq.IMMEDIATE, 1)
            self.sock.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
            if self.keys is not None:
                self.keys.apply(self.sock)
            connect(self.sock, self.address)
        return self.sock

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(0)
            self.sock = None

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()

    def call(self, cmd: str, args: Mapping[str, Any] | None = None) -> Any:
        """Send one command and return its result; raises RemoteError or Unavailable."""
        with self._calling:
            return self._call(cmd, args)

    def _call(self, cmd: str, args: Mapping[str, Any] | None) -> Any:
        req_id = uuid.uuid4().hex
        frame = encode_request(req_id, cmd, args or {})
        for _ in range(self.retries + 1):
            sock = self._socket()
            try:
                sock.send(frame)
            except zmq.Again:  # no peer within the timeout: silence, as below
                self.close()
                continue
            while sock.poll(self.timeout_ms):
                try:
                    reply = unpack(sock.recv(), max_bytes=MAX_WIRE_BYTES)
                except ProtocolError:
                    continue
                if not isinstance(reply, dict):
                    continue
                # one request is outstanding per socket: an error without an id (the frame
                # could not be read) answers it; another id is a late reply to an earlier try
                if reply.get("id") != req_id and not (reply.get("id") is None
                                                      and reply.get("ok") is False):
                    continue
                if reply.get("ok"):
                    return reply.get("result")
                err = reply.get("error") or {}
                raise RemoteError(str(err.get("code")), str(err.get("message")), err.get("field"))
            self.close()  # a fresh socket, so a reply to the old one cannot arrive late
        hint = ("is it running, and is this key allowed there?" if self.keys is not None else
                "is it running? (a server started with --auth also needs --key and --server-key)")
        raise Unavailable(f"no answer from {self.address} within {self.timeout_ms / 1000:g} s "
                          f"({self.retries + 1} tries); {hint}")


def list_adapters(client: ControlClient, *, after: str | None = None,
                  limit: int | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The registry by name from after `after`, at most `limit` adapters (None: all), fetched
    page by page; returns the first reply (head_seq, pool, count) and the adapters."""
    first: dict[str, Any] | None = None
    out: list[dict[str, Any]] = []
    while limit is None or len(out) < limit:
        args: dict[str, Any] = {"limit": MAX_LIST_PAGE if limit is None
                                else min(MAX_LIST_PAGE, limit - len(out))}
        if after is not None:
            args["after"] = after
        res = client.call("list", args)
        first = first or res
        out += res["adapters"]
        after = res.get("next_after")
        if after is None:
            break
    assert first is not None or limit == 0
    return first or {}, out


def new_event_id() -> str:
    return str(uuid.uuid4())
