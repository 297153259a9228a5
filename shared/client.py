"""A control-socket client: one request, one reply, retried on silence.

Writes carry a client-chosen event_id, so resending after a timeout is safe:
the state service records the command once and answers a retry with the
original result (the ZeroMQ Guide's Lazy Pirate pattern).

The address may name several statesvc instances of one log (`a,b`, docs/postgres.md): a
try that meets silence moves to the next one, and the client stays there while it answers.
Every instance decides on the same log and answers a retried event_id with its original
result, so a write resent to another instance is still recorded once.
"""
from __future__ import annotations

import threading
import uuid
from typing import Any, Mapping

import zmq

from shared.config import MAX_LIST_PAGE, MAX_WIRE_BYTES
from shared.endpoints import connect, split_addresses
from shared.errors import CodedError
from shared.keys import ClientKeys
from shared.protocol import ProtocolError, encode_request, unpack


class RemoteError(CodedError):
    """The service answered with an error."""


class Unavailable(Exception):
    """No answer within the timeout, after the retries."""


class Unsendable(ValueError):
    """An argument the wire cannot carry (text that is not valid UTF-8, an integer beyond 64
    bits); nothing was sent. The message names the argument."""


def _unsendable(value: Any, where: str) -> str | None:
    """What in `value` msgpack cannot encode, named by its place under `where`, and why."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return f"{where} ({value!r}) is not valid UTF-8 text"
    elif isinstance(value, int) and not isinstance(value, bool):
        if not -2**63 <= value < 2**64:
            return f"{where} is an integer beyond 64 bits"
    elif isinstance(value, Mapping):
        for k, v in value.items():
            problem = _unsendable(k, f"{where} key") or _unsendable(v, f"{where}.{k}")
            if problem:
                return problem
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            problem = _unsendable(v, f"{where}[{i}]")
            if problem:
                return problem
    return None


class ControlClient:
    def __init__(self, address: str, *, timeout_s: float = 10.0, retries: int = 2,
                 context: zmq.Context[Any] | None = None, keys: ClientKeys | None = None) -> None:
        self.addresses = split_addresses(address)
        self.current = 0  # the instance asked first; moves on silence
        self.keys = keys
        self.timeout_ms = int(timeout_s * 1000)
        self.retries = retries
        self.ctx = context or zmq.Context.instance()
        self.sock: zmq.Socket[Any] | None = None
        # one request at a time: a replica's sync thread and its engine (filling a slot on a
        # miss) share one client, and a ZeroMQ socket is not thread-safe
        self._calling = threading.Lock()

    @property
    def address(self) -> str:
        """The instance this client asks now."""
        return self.addresses[self.current]

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
        try:
            frame = encode_request(req_id, cmd, args or {})
        except (ValueError, OverflowError) as exc:  # UnicodeEncodeError is a ValueError
            problem = _unsendable(dict(args or {}), "args") or f"its args: {exc}"
            raise Unsendable(f"cannot send {cmd}: {problem}") from None
        # every instance gets at least one try, and the silent one is left for the next
        tries = max(self.retries + 1, len(self.addresses))
        for _ in range(tries):
            sock = self._socket()
            try:
                sock.send(frame)
            except zmq.Again:  # no peer within the timeout: silence, as below
                self._next()
                continue
            while sock.poll(self.timeout_ms):
                try:
                    # read in place: a blob chunk's bytes are copied once, by msgpack
                    reply = unpack(sock.recv(copy=False).buffer, max_bytes=MAX_WIRE_BYTES)
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
            self._next()  # a fresh socket, so a reply to the old one cannot arrive late
        hint = ("is it running, and is this key allowed there?" if self.keys is not None else
                "is it running? (a server started with --auth also needs --key and --server-key)")
        raise Unavailable(f"no answer from {','.join(self.addresses)} within "
                          f"{self.timeout_ms / 1000:g} s ({tries} tries); {hint}")

    def _next(self) -> None:
        """Drop the socket and move to the next instance (the same one when there is one)."""
        self.close()
        self.current = (self.current + 1) % len(self.addresses)


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
