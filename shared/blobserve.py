"""Blob chunks served off a service's loop: statesvc's, and a replica's to its peers.

A replica fetches an adapter's weights chunk by chunk (`blob`), from statesvc, or from a peer
replica that holds the blob (computed/residency/blob_cache.py). Read on the loop's thread, those reads
would queue commands, heartbeats and decode steps behind them. The loop hands each decoded
`blob` request to this thread instead; it reads the chunk (from statesvc's blob files or
PostgreSQL through the engine's connection pool, or from a replica's blob cache, each safe
from another thread) and sends the finished reply back over an inproc PUSH socket, which the
loop polls and forwards on its ROUTER (a ZeroMQ socket belongs to one thread). Blobs are
content-addressed and immutable, so a chunk needs nothing else of the service's state.
"""
from __future__ import annotations

import logging
import queue
import threading
import uuid
from typing import Any, Callable, Protocol

import zmq

from shared.errors import CodedError, cause
from shared.protocol import Request, error_reply, error_reply_of, ok_reply
from shared.threadname import name_os_thread

log = logging.getLogger("blobs")

# decoded blob requests waiting for the thread; beyond this one is answered `overloaded`
# (replicas fetch one chunk at a time each, so this bounds a greedy client, not a fleet)
MAX_QUEUED = 1024
# finished replies on their way to the loop at most: one in each end's queue (HWM 1), one
# being sent, one being forwarded; a client that reads none is bounded by shared.router
IN_FLIGHT = 4
SEND_RETRY_MS = 200


class ChunkSource(Protocol):
    def has(self, sha: str) -> bool: ...

    def size(self, sha: str) -> int: ...

    def read_chunk(self, sha: str, offset: int, length: int) -> bytes: ...


def read_chunk(blobs: ChunkSource, args: dict[str, Any]) -> dict[str, Any]:
    """The `blob` command's answer: `length` bytes of blob `sha256` from `offset`."""
    sha = args["sha256"]
    if not blobs.has(sha):
        raise CodedError("not_found", f"no blob {sha}", "args.sha256")
    size = blobs.size(sha)
    if args["offset"] > size:
        raise CodedError("bad_request", f"offset {args['offset']} is beyond the blob's "
                         f"{size} bytes", "args.offset")
    data = blobs.read_chunk(sha, args["offset"], args["length"])
    return {"sha256": sha, "offset": args["offset"], "size": size, "data": data}


class BlobServer(threading.Thread):
    """Answers `blob` requests with `read(args)`; replies come out of `self.replies`."""

    def __init__(self, ctx: zmq.Context[Any], read: Callable[[dict[str, Any]], Any],
                 before_read: Callable[[], None] = lambda: None,
                 storage_errors: tuple[type[Exception], ...] = ()) -> None:
        super().__init__(name="blobs", daemon=True)
        self.read = read
        # what `read` raises when its store fails (statesvc's database): a retryable storage_error.
        # A replica's reader has none (its own files), so a replica never imports SQLAlchemy.
        self.storage_errors = storage_errors
        self.before_read = before_read  # a test-only pause (shared/faults.py)
        self.requests: queue.Queue[tuple[list[bytes], Request] | None] = queue.Queue(MAX_QUEUED)
        address = f"inproc://blobs-{uuid.uuid4().hex}"
        self.replies = ctx.socket(zmq.PULL)  # the loop's end
        self.replies.setsockopt(zmq.RCVHWM, 1)
        self.replies.bind(address)
        self._push = ctx.socket(zmq.PUSH)  # this thread's end
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.setsockopt(zmq.SNDHWM, 1)
        self._push.setsockopt(zmq.SNDTIMEO, SEND_RETRY_MS)
        self._push.connect(address)
        self._stopping = threading.Event()

    def submit(self, envelope: list[bytes], req: Request) -> bytes | None:
        """Queue `req`; None, or the reply when the queue is full (the loop never waits)."""
        try:
            self.requests.put_nowait((envelope, req))
            return None
        except queue.Full:
            return error_reply(req.id, "overloaded", f"{MAX_QUEUED} blob reads are queued; "
                               "retry the chunk later")

    def stop(self) -> None:
        self._stopping.set()
        try:
            self.requests.put_nowait(None)
        except queue.Full:
            pass  # the thread sees _stopping after its current reply
        self.join(5)
        self.replies.close(0)

    def run(self) -> None:
        name_os_thread()
        try:
            while not self._stopping.is_set() and (item := self.requests.get()) is not None:
                envelope, req = item
                frames = envelope + [self._answer(req)]
                while not self._stopping.is_set():
                    try:  # waits while the loop has IN_FLIGHT replies to forward
                        self._push.send_multipart(frames, copy=False)  # the chunk: no copy
                        break
                    except zmq.Again:
                        continue
        finally:
            self._push.close(0)

    def _answer(self, req: Request) -> bytes:
        try:
            self.before_read()
            return ok_reply(req.id, self.read(req.args))
        except CodedError as exc:
            return error_reply_of(req.id, exc)
        except self.storage_errors as exc:
            return error_reply(req.id, "storage_error", "the blob could not be read "
                               f"({cause(exc)}); retry")
        except Exception as exc:  # a bug costs one answer, never the thread
            log.exception("internal error reading a blob chunk")
            return error_reply(req.id, "internal_error", f"internal error "
                               f"({type(exc).__name__}); please report it")

