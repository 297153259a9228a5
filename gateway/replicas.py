"""`generate` calls to replicas, as the gateway makes them, on its event loop: no thread and
no poller per request. Each call runs on a DEALER connected to its replica, kept per replica
and reused one request at a time (a request does not pay for a TCP connection and
handshake; a replica's listen socket holds at most a few unread replies per connection,
docs/protocol.md §13b, so streams do not share one). The loop watches the socket's file
descriptor: when it fires, every frame that has arrived is read and handed on at once (a
token to `on_token`, the result to `on_result` and the waiting request). A socket monitor
reports a dropped connection the same way, so a request to a replica that dies fails at
once (Unavailable), and the gateway can try another replica instead of waiting out the
request timeout."""
from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, Callable

import msgpack
import zmq

from shared.client import RemoteError, Unavailable
from shared.config import MAX_WIRE_BYTES
from shared.endpoints import connect
from shared.keys import ClientKeys
from shared.protocol import ProtocolError, encode_request, no_ext, unpack
from shared.replica_protocol import CANCEL, GENERATE

MAX_IDLE_PER_REPLICA = 64
CANCEL_LINGER_MS = 1000  # a link closed after a cancel still sends it this long
_POLLIN, _POLLOUT = int(zmq.POLLIN), int(zmq.POLLOUT)  # plain ints: no enum arithmetic per frame


class _Link:
    """One connected DEALER and its disconnect monitor; one request at a time."""

    def __init__(self, ctx: zmq.Context[Any], address: str, keys: ClientKeys | None) -> None:
        self.address = address
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_WIRE_BYTES)
        self.sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only to a connected peer
        if keys is not None:
            keys.apply(self.sock)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        connect(self.sock, address)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.req_id = ""
        self.on_token: Callable[[int, int, dict[str, Any]], None] | None = None  # (choice, token, frame)
        self.on_result: Callable[[dict[str, Any]], None] | None = None
        self.streamed = 0  # choice 0's tokens so far
        self.streamed_by: dict[int, int] = {}  # the other choices' (n > 1)
        self.done: asyncio.Future[dict[str, Any]] | None = None
        self.writable: asyncio.Future[None] | None = None

    def gone(self) -> bool:
        """The connection dropped since the link was last used."""
        return bool(self.monitor.poll(0))

    def start(self, req_id: str, on_token: Callable[[int, int, dict[str, Any]], None] | None,
              on_result: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        self.req_id, self.on_token, self.on_result, self.streamed = req_id, on_token, on_result, 0
        self.streamed_by = {}
        self.done = self.loop.create_future()
        self.loop.add_reader(self.sock.fd, self._events)
        self.loop.add_reader(self.monitor.fd, self._monitor)
        # read the monitor once now: its descriptor only fires for an event that finds the
        # socket's pipe idle, and a pipe counts as idle only after a read found it empty (the
        # first disconnect was never seen, and a stream on a killed replica waited out the
        # request timeout)
        self._monitor()

    def stop(self) -> None:
        if self.loop is not None:
            self.loop.remove_reader(self.sock.fd)
            self.loop.remove_reader(self.monitor.fd)
            self.loop = None
        self.done = self.writable = None
        self.on_token = self.on_result = None

    async def send(self, frame: bytes, timeout_s: float) -> None:
        """Send once the connection is up (IMMEDIATE: nothing queues before it is)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.sock.send(frame, zmq.NOBLOCK)
                break
            except zmq.Again:
                left = deadline - time.monotonic()
                if left <= 0 or self.loop is None:
                    raise Unavailable(f"no connection to {self.address} within {timeout_s:g} s")
                self.writable = self.loop.create_future()
                try:
                    await asyncio.wait_for(self.writable, left)
                except asyncio.TimeoutError:
                    pass
        self._events()  # a send may consume the descriptor's edge: read what is there

    def _events(self) -> None:
        """The socket's descriptor fired (edge-triggered): act on everything ready now."""
        while True:
            events = self.sock.getsockopt(zmq.EVENTS)
            if events & _POLLOUT and self.writable is not None and not self.writable.done():
                self.writable.set_result(None)
            if not events & _POLLIN:
                return
            raw = self.sock.recv(zmq.NOBLOCK)
            done = self.done
            if done is None or done.done():
                continue
            try:  # a token frame is read as it is; anything else is checked whole
                reply = msgpack.unpackb(raw, raw=False, strict_map_key=True, ext_hook=no_ext)
            except Exception:
                continue
            if not isinstance(reply, dict) or reply.get("id") != self.req_id:
                continue
            token = reply.get("token")
            if isinstance(token, dict):
                if reply.get("ok") is not True or type(token.get("id")) is not int \
                        or self.on_token is None:
                    continue
                choice = token.get("choice")
                if choice is None:
                    if token.get("index") == self.streamed:
                        self.streamed += 1
                        self.on_token(0, token["id"], token)
                elif type(choice) is int and 0 < choice and \
                        token.get("index") == self.streamed_by.get(choice, 0):
                    self.streamed_by[choice] = token["index"] + 1
                    self.on_token(choice, token["id"], token)
                continue
            try:
                reply = unpack(raw, max_bytes=MAX_WIRE_BYTES)
            except ProtocolError:
                continue
            if reply.get("ok"):
                result = dict(reply["result"])
                done.set_result(result)  # its waiter resumes on a later turn of the loop
                if self.on_result is not None:
                    self.on_result(result)
            else:
                err = reply.get("error") or {}
                done.set_exception(RemoteError(str(err.get("code")), str(err.get("message")),
                                               err.get("field")))

    def _monitor(self) -> None:
        try:
            while True:
                self.monitor.recv_multipart(zmq.NOBLOCK)  # only EVENT_DISCONNECTED is asked
                if self.done is not None and not self.done.done():
                    self.done.set_exception(Unavailable(
                        f"{self.address} dropped the connection before answering"))
        except zmq.Again:
            pass

    def close(self, linger_ms: int = 0) -> None:
        """linger_ms: how long libzmq may still spend sending what was queued (a cancel)."""
        self.stop()
        self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close(linger_ms)


def _expire(done: asyncio.Future[dict[str, Any]], address: str, timeout_s: float) -> None:
    if not done.done():
        done.set_exception(Unavailable(f"no answer from {address} within {timeout_s:g} s"))


class ReplicaLinks:
    """Idle connected links per replica address, used on the event loop's thread only."""

    def __init__(self, ctx: zmq.Context[Any], keys: ClientKeys | None = None) -> None:
        self.ctx, self.keys = ctx, keys
        self._idle: dict[str, list[_Link]] = {}

    def _take(self, address: str) -> _Link:
        idle = self._idle.get(address, [])
        while idle:
            link = idle.pop()
            if not link.gone():
                return link
            link.close()
        return _Link(self.ctx, address, self.keys)

    def _give_back(self, link: _Link) -> None:
        link.stop()
        idle = self._idle.setdefault(link.address, [])
        if len(idle) < MAX_IDLE_PER_REPLICA:
            idle.append(link)
        else:
            link.close()

    async def generate(self, address: str, args: dict[str, Any], *, connect_timeout_s: float,
                       timeout_s: float,
                       on_token: Callable[[int, int, dict[str, Any]], None] | None = None,
                       on_result: Callable[[dict[str, Any]], None] | None = None
                       ) -> dict[str, Any]:
        """The replica's result; RemoteError for its refusal, Unavailable when it cannot be
        reached within connect_timeout_s, goes away, or does not answer within timeout_s.
        With `on_token`, the request streams: each token is passed to it as it arrives.
        `on_result` is handed the result as soon as it is read, in the same turn of the loop
        as the tokens read with it (the request's own task resumes a turn later).
        Cancelled (the HTTP client went away), it tells the replica to drop the request."""
        link = self._take(address)
        req_id = uuid.uuid4().hex
        if on_token is not None:
            args = {**args, "stream": True}
        link.start(req_id, on_token, on_result)
        frame = encode_request(req_id, GENERATE, args)
        sent = False
        try:
            # one turn of the loop first: the other requests of a burst that arrived with
            # this one get here too, and all go out together (a replica admits what has
            # arrived into one batched prefill; a burst spread over the gateway's work on
            # it would be prefilled in two)
            await asyncio.sleep(0)
            await link.send(frame, connect_timeout_s)
            sent = True
            done = link.done
            assert done is not None and link.loop is not None
            # a timer rather than wait_for: wait_for passes the result on through a callback
            # of its own, a turn of the loop later
            timer = link.loop.call_later(timeout_s, _expire, done, address, timeout_s)
            try:
                result = await done
            finally:
                timer.cancel()
        except RemoteError:
            self._give_back(link)
            raise
        except BaseException:
            # a reply may still come for this request: never reuse the socket; and a
            # request that runs on is cancelled there (the client went away, or no answer)
            cancelled = sent and self._cancel(link, req_id)
            link.close(CANCEL_LINGER_MS if cancelled else 0)
            raise
        self._give_back(link)
        return result

    @staticmethod
    def _cancel(link: _Link, req_id: str) -> bool:
        """Ask the replica to drop `req_id` (its answers go unread); best effort."""
        try:
            link.sock.send(encode_request(uuid.uuid4().hex, CANCEL, {"id": req_id}),
                           zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        return True
