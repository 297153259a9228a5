"""The state service's sockets: a ROUTER for commands and a PUB for diffs and heartbeats.

One thread. Each wake-up drains every request already queued (up to
MAX_BATCH) and hands them to `StateService.handle` together, so concurrent
commands share one durable commit; requests that arrive while the batch's
writes are being validated join it before that commit. Diffs are published
after the commit and before the replies; a heartbeat with the head seq goes
out every second, also while a load reads and checks large weights (the
service calls back into the loop for it).

`blob` requests are read on a thread of their own (shared/blobserve.py): chunks served to
a fleet of replicas never hold up commands or heartbeats.

On a shared log (PostgreSQL, several instances) the loop also polls the store's doorbell
(LISTEN/NOTIFY) and, when it rings and once every CATCH_UP_S anyway, reads the events other
instances appended and publishes them: every instance publishes every event, in seq order.
"""
from __future__ import annotations

import logging
import signal
import time
from pathlib import Path
from typing import Any

import zmq
from sqlalchemy.exc import OperationalError

from shared.config import HEARTBEAT_INTERVAL_S, HELD_REPLY_RETRY_MS
from shared.endpoints import bind, check_bind
from shared.errors import cause
from shared.events import Event
from shared.faults import Faults
from shared.keys import CONTROL, ServerAuth, check_command
from shared.protocol import (ProtocolError, Request, decode_request, error_reply, error_reply_of,
                             ok_reply, pack, request_id_of, unpack)
from shared.reducer import diff_of_payload
from shared.router import Replies, serving_router, split_request
from shared.blobserve import BlobServer
from statesvc.persistence.postgres import PostgresEventStore
from statesvc.service import StateService

log = logging.getLogger("statesvc")

MAX_BATCH = 512
# Largest frame a subscriber may send: its subscriptions (b"", b"diff", b"hb") and, with
# CURVE, its handshake.
MAX_SUBSCRIBER_FRAME_BYTES = 4096
LOCAL_ACTOR = "local"
CATCH_UP_S = 1.0  # a shared log is read this often even when no NOTIFY came (not durable)
class Server:
    def __init__(self, service: StateService, *, control: str, publish: str,
                 heartbeat_interval: float = HEARTBEAT_INTERVAL_S,
                 auth_dir: Path | None = None) -> None:
        self.service = service
        self.heartbeat_interval = heartbeat_interval
        self.faults = Faults.from_env()  # test-only (shared/faults.py): off unless switched on
        self.ctx = zmq.Context()
        self.auth = None if auth_dir is None else ServerAuth(self.ctx, auth_dir)
        authenticated = self.auth is not None
        self.router, self.control = serving_router(
            self.ctx, check_bind(control, authenticated=authenticated), self.auth)
        self.replies = Replies(self.router)
        self.pub = self.ctx.socket(zmq.PUB)
        if self.auth is not None:
            self.auth.apply(self.pub)
        self.pub.setsockopt(zmq.SNDHWM, 100_000)
        self.pub.setsockopt(zmq.MAXMSGSIZE, MAX_SUBSCRIBER_FRAME_BYTES)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.publish = bind(self.pub, check_bind(publish, authenticated=authenticated))
        self._stop = False
        self._next_beat = time.monotonic()
        # the head that heartbeats announce: the last seq whose diff went out (a commit in
        # the middle of a batch is announced with the batch's diffs, not before them)
        self._announced = service.state.seq
        service.progress = self._beat_if_due
        store = service.store
        self.doorbell = store.doorbell() if isinstance(store, PostgresEventStore) else None
        self._next_catch_up = time.monotonic()
        self.blobs = BlobServer(self.ctx, service.blob, self.faults.before_blob_read,
                                storage_errors=(OperationalError,))

    def stop(self, *_: Any) -> None:
        self._stop = True

    def serve_forever(self) -> None:
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.blobs.replies, zmq.POLLIN)
        bell: int | None = None
        self.blobs.start()
        try:
            while not self._stop:
                self._beat_if_due()
                timeout_ms = max(0, int((self._next_beat - time.monotonic()) * 1000)) + 1
                if self.replies.held:
                    timeout_ms = min(timeout_ms, HELD_REPLY_RETRY_MS)
                if self.doorbell is not None and self.doorbell.fileno() != bell:
                    if bell is not None:  # a new connection: poll it instead
                        poller.unregister(bell)
                    bell = self.doorbell.fileno()
                    if bell is not None:
                        poller.register(bell, zmq.POLLIN)
                    self._next_catch_up = 0.0  # notices may have been missed meanwhile
                ready = dict(poller.poll(min(timeout_ms, 250)))
                if self.router in ready:
                    self._serve_batch()
                if self.blobs.replies in ready:
                    while self.blobs.replies.poll(0):  # forwarded as received: no copy
                        self.replies.send(self.blobs.replies.recv_multipart(copy=False))
                if self.doorbell is not None and (
                        (bell in ready and self.doorbell.rang(self.service.state.seq))
                        or time.monotonic() >= self._next_catch_up):
                    self._catch_up()
                self.replies.flush()
        finally:
            self.blobs.stop()
            if self.doorbell is not None:
                self.doorbell.close()
            self.router.close(0)
            self.pub.close(0)
            if self.auth is not None:
                self.auth.stop()
            self.ctx.term()

    def _beat_if_due(self) -> None:
        now = time.monotonic()
        if now >= self._next_beat:
            self._heartbeat()
            self._next_beat = now + self.heartbeat_interval

    def _heartbeat(self) -> None:
        head = self._announced
        self.pub.send_multipart([b"hb", pack({"head_seq": head,
                                              "digest": self.service.digest_at(head),
                                              "ts": time.time(),
                                              "log_id": self.service.log_id})])

    def _serve_batch(self) -> None:
        batch: list[tuple[list[bytes], Request, str]] = []

        def more() -> list[tuple[Request, str]]:
            # requests that arrived while the batch was being validated join its commit
            start = len(batch)
            self._receive(batch)
            return [(req, actor) for _, req, actor in batch[start:]]

        self._receive(batch)
        if not batch:
            return
        try:
            answers, committed = self.service.handle(
                [(req, actor) for _, req, actor in batch], more=more)
        except Exception as exc:  # a bug: every request of the batch answered, and serve on
            log.exception("internal error handling a batch")
            for envelope, req, _ in batch:
                self.replies.send(envelope + [error_reply(
                    req.id, "internal_error", f"internal error ({type(exc).__name__}); the "
                    "outcome is unknown: retry with the same event_id; please report it")])
            return
        self._publish(committed)
        for (envelope, req, _), ans in zip(batch, answers):
            if ans.error is not None:
                frame = error_reply_of(req.id, ans.error)
            else:
                frame = ok_reply(req.id, ans.result)
            self.replies.send(envelope + [frame])

    def _publish(self, events: list[Event]) -> None:
        for ev in events:
            if not self.faults.publishes(ev.seq):
                continue
            self.pub.send_multipart([b"diff", pack(diff_of_payload(
                ev.seq, ev.type, ev.payload, log_id=self.service.log_id))])
        self._announced = self.service.state.seq

    def _catch_up(self) -> None:
        """Publish the events other instances appended to the shared log."""
        self._next_catch_up = time.monotonic() + CATCH_UP_S
        try:
            self._publish(self.service.catch_up())
        except OperationalError as exc:  # unreachable: commands answer storage_error meanwhile
            log.warning("reading the shared log failed (%s); retrying in %.0f s",
                        cause(exc), CATCH_UP_S)
        except Exception:
            log.exception("reading the shared log failed; retrying in %.0f s", CATCH_UP_S)

    def _receive(self, batch: list[tuple[list[bytes], Request, str]]) -> None:
        """Append the requests already queued to `batch`, up to MAX_BATCH requests; hand blob
        reads to the blob thread; answer bad frames."""
        while len(batch) < MAX_BATCH:
            try:
                raw = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            envelope: list[bytes] = [raw[0].bytes]
            body = b""
            try:
                envelope, frame = split_request(raw)
                body = frame.bytes
                # with CURVE, the authenticator named the client (ROLE:NAME) on each message
                actor = str(frame.get("User-Id")) if self.auth is not None else LOCAL_ACTOR
                req = decode_request(body)
                check_command(CONTROL, actor if self.auth is not None else None, req.cmd)
                if req.cmd == "blob":
                    if (refused := self.blobs.submit(envelope, req)) is not None:
                        self.replies.send(envelope + [refused])
                else:
                    batch.append((envelope, req, actor))
            except ProtocolError as exc:
                self.replies.send(envelope + [error_reply_of(_safe_id(body), exc)])
            except Exception as exc:  # a decoder bug must cost one answer, never the service
                log.exception("internal error decoding a frame")
                self.replies.send(envelope + [error_reply(
                    None, "internal_error", f"internal error ({type(exc).__name__}); please "
                    "report it")])


def _safe_id(body: bytes) -> str | None:
    try:
        return request_id_of(unpack(body))
    except ProtocolError:
        return None
