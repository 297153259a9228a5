"""The replica daemon: the serving loop over the sync thread (computed/sync.py).

The main thread owns the ROUTER at --listen: status, slot reads, `generate`,
which the engine batches continuously, and `cancel` of a client's own
`generate`; while requests run it steps
the engine between polls. Under --auth, slot reads and the process details in
`status` are for operator keys only; without it the socket is loopback-only and
every local caller gets everything.

Peer replicas fetch blobs this one has cached with `blob` (statesvc's command): the chunks are
read on a thread of their own (shared/blobserve.py), so a peer's fetch never holds up a
decode step. Under --auth only replica and operator keys may read them (they are adapter
weights); a replica key may call nothing but `blob` and `status` (shared/keys.py
`ROLE_COMMANDS`).
"""
from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import zmq

from computed.model.compile_cache import COMPILES
from computed.serving.engine import Engine
from computed.serving.rows import Done, Request
from computed.replica import Replica
from computed.sync import IDLE_POLL_MS, SyncLoop, digests
from shared import memtune
from shared.blobserve import BlobServer, read_chunk
from shared.config import HELD_REPLY_RETRY_MS
from shared.endpoints import check_bind
from shared.keys import INFERENCE, INFERENCE_ROLES, ClientKeys, ServerAuth, check_command, role_of
from shared.protocol import Request as WireRequest
from shared.protocol import (ProtocolError, error_reply_of, ok_reply, pack, request_id_of, unpack,
                             validate)
from shared.replica_protocol import (BLOB, BLOB_ARGS, CANCEL, CANCEL_ARGS, GENERATE, SLOT_ARGS,
                                     STATUS, decode_replica_request, token_frame)
from shared.router import Replies, serving_router, split_request
from shared.threadname import name_os_thread

log = logging.getLogger("computed")

WAITING_POLL_MS = 2
# a stop waits this long at most for the warm-up's compile in progress (one bucket or window)
WARMUP_STOP_S = 60.0


def residency_stats(r: Replica) -> dict[str, Any] | None:
    """Hits, misses and evictions of the replica's slots (computed/residency/slots.py), its host
    tier's and its fill times per tier (computed/residency/host_tier.py)."""
    res = r.residency
    if res is None:
        return None
    return {"slots": res.slots, "resident": len(res.holders),
            "pinned": sum(h.pinned for h in res.holders.values()), "hits": res.hits,
            "misses": res.misses, "evictions": res.evictions,
            "reserved": None if res.reserved is None else res.reserved[1],
            **r.fills.stats()}


def _nbytes(tree: Any) -> int:
    return sum(int(getattr(a, "nbytes", 0)) for a in jax.tree.leaves(tree))


def memory_report(r: Replica, engine: Engine, weights: int) -> dict[str, int]:
    """The replica's resident memory beside its parts (bytes): the model's weights as loaded
    (packed for the kernels), the running rows' KV cache, the prefix cache's block store, the
    LoRA pool, the host tier's parsed adapters and the blob cache's blobs held in memory; the
    rest (`other`: the interpreter, jax, XLA's executables, buffers of a step) is RSS less those."""
    host = r.fills.stats().get("host_bytes", 0) if r.residency is not None else 0
    parts = {"weights": weights, "kv_rows": _nbytes(engine.cache), "prefix_store": _nbytes(engine.prefills.store),
             "lora_pool": 0 if r.pool is None else _nbytes(r.pool.arrays), "host_tier": int(host or 0)}
    rss = memtune.rss_bytes()
    return {"rss": rss, **parts, "other": rss - sum(parts.values())}


class Daemon:
    def __init__(self, replica: Replica, *, replica_id: str, listen: str, state: str,
                 diffs: str, engine: Engine | None = None, warmup: bool = True,
                 heartbeat: bool = True, about: dict[str, Any] | None = None,
                 keys: ClientKeys | None = None, auth_dir: Path | None = None) -> None:
        self.replica = replica
        self.warmup = warmup
        self.about = about or {}  # process details (the model dir): operators only under --auth
        self.replica_id = replica_id
        self.engine = engine
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.auth = None if auth_dir is None else ServerAuth(ctx, auth_dir, INFERENCE_ROLES)
        self.router, self.listen = serving_router(
            ctx, check_bind(listen, authenticated=self.auth is not None), self.auth)
        self.replies = Replies(self.router)
        self.blob_server = BlobServer(ctx, lambda args: read_chunk(replica.blobs, args))
        if engine is not None:
            engine.on_token = self._token
        self._weights_bytes = 0 if engine is None else _nbytes(getattr(engine.model, "params", None))
        self.sync = SyncLoop(replica, replica_id=replica_id, listen=self.listen, state=state,
                             diffs=diffs, heartbeat=heartbeat, keys=keys)
        self._stop = False

    def stop(self, *_: Any) -> None:
        self._stop = True

    def serve_forever(self) -> None:
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)
        wake, waker = socket.socketpair()  # a signal's byte ends the poll at once
        wake.setblocking(False)
        waker.setblocking(False)
        old_wakeup = signal.set_wakeup_fd(waker.fileno())
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.blob_server.replies, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        self.blob_server.start()
        self.sync.start()
        warming: threading.Thread | None = None
        try:
            while not self._stop and self.sync.is_alive():
                if self.warmup and self.engine is not None and warming is None \
                        and self.replica.pool is not None:
                    # compile in the background: status keeps answering meanwhile, and
                    # requests wait in the queue until the engine is warm
                    warming = threading.Thread(target=self._warm, name="warmup", daemon=True)
                    warming.start()
                if not self.warmup and self.engine is not None:
                    self.engine.warm = True  # --no-warmup: shapes compile as requests need them
                ready = self.engine is not None and self.engine.warm
                busy = ready and self.engine is not None and self.engine.busy
                # only waiters (a fetch, a slot, a min_seq): poll briefly instead of spinning
                # against the fill worker
                stepping = busy and self.engine is not None and self.engine.stats()["running"]
                wait_ms = 0 if stepping else WAITING_POLL_MS if busy else \
                    HELD_REPLY_RETRY_MS if self.replies.held else IDLE_POLL_MS
                polled = dict(poller.poll(wait_ms))
                if wake in polled:
                    wake.recv(4096)  # the handler has run: `self._stop` says what to do
                if self.router in polled:
                    self._serve_clients()
                if self.blob_server.replies in polled:
                    self._forward_blobs()
                if busy and self.engine is not None:
                    # requests that arrive while the step prefills are admitted in it
                    self._send(self.engine.step(intake=self._serve_clients))
                    self.replica.faults.after_step()  # test-only; a no-op unless switched on
                self.replies.flush()
        finally:
            self._stop = True  # a warm-up ends before its next compile
            signal.set_wakeup_fd(old_wakeup)
            wake.close()
            waker.close()
            self.sync.stop()
            self.sync.join(10)
            self.blob_server.stop()
            self.router.close(0)
            if self.auth is not None:
                self.auth.stop()
            if warming is not None:  # no thread may be inside XLA when the interpreter ends
                warming.join(WARMUP_STOP_S)
                if warming.is_alive():
                    log.warning("the warm-up's compile is still running after %.0f s; "
                                "exiting anyway", WARMUP_STOP_S)
        if self.sync.fatal is not None:
            raise self.sync.fatal

    def _warm(self) -> None:
        """Warm the engine up: it serves once every request can run (`inference.state` ready),
        while the forwards of several prompts at once go on compiling (`warmup.pending` true)."""
        name_os_thread()
        assert self.engine is not None
        engine = self.engine
        t0, before = time.perf_counter(), COMPILES.start().snapshot()

        def report(pending: bool) -> dict[str, Any]:
            after, seconds = COMPILES.snapshot(), time.perf_counter() - t0
            return {"seconds": round(seconds, 2), "compiles": after.compiled - before.compiled,
                    "cache_hits": after.cache_hits - before.cache_hits, "pending": pending}

        def ready() -> None:
            engine.warmup_report = {**report(True), "ready_s": round(time.perf_counter() - t0, 2)}
            log.info("inference ready in %.1f s (%d compiles, %d from the compilation cache); "
                     "compiling the rest", engine.warmup_report["seconds"], engine.warmup_report["compiles"],
                     engine.warmup_report["cache_hits"])
        engine.warmup(stop=lambda: self._stop, pause=self.replica.faults.after_warmup, ready=ready)
        memtune.release()  # what tracing and compiling freed
        if engine.warm and not self._stop:
            done = report(False)
            engine.warmup_report = {**done, "ready_s": (engine.warmup_report or done).get("ready_s", done["seconds"])}
            log.info("inference warmed up in %.1f s (%d compiles, %d from the compilation cache)",
                     done["seconds"], done["compiles"], done["cache_hits"])

    def status(self, *, details: bool = True) -> dict[str, Any]:
        r = self.replica
        pool = r.pool
        return {"id": self.replica_id, "address": self.listen, **digests(r),
                **(self.about if details else {}),
                "slot_digests": None if pool is None or pool.pending else
                pool.slot_digests(),
                "syncing_seq": r.syncing_seq,
                "head_seq_seen": self.sync.remote_head, "last_error": r.last_error,
                "log_id": r.log_id,
                "applied_at": r.applied_at, "blob_fetches": r.blobs.fetches,
                "peer_blob_fetches": r.blobs.peer_fetches,
                "inference": None if self.engine is None else
                {**self.engine.stats(), "memory": memory_report(r, self.engine, self._weights_bytes)},
                "slots": {str(s): {"name": h.name, "version": h.version, "pinned": h.pinned,
                                   "digest": None if pool is None or pool.pending else d,
                                   "sha256": h.sha256}
                          for s, (h, d) in r.resident().items()},
                "host_tier": [{"name": n, "version": v, "sha256": sha}
                              for n, v, sha in r.host_tier()],
                "adapter_requests": None if self.engine is None else
                self.engine.adapter_requests(),
                "prefix_cache": None if self.engine is None else self.engine.prefills.status(),
                "residency": residency_stats(r)}

    def _forward_blobs(self) -> None:
        """Send the blob thread's finished replies (as read: no copy)."""
        while self.blob_server.replies.poll(0):
            self.replies.send(self.blob_server.replies.recv_multipart(copy=False))

    def _token(self, req: Request, index: int, token: int, choice: int,
               scores: dict[str, Any] | None) -> None:
        """One token of a streaming `generate`, sent as soon as it is sampled."""
        self.replies.send(req.reply_to + [pack(token_frame(req.req_id, index, token, choice,
                                                           scores))])

    def _send(self, done: list[Done]) -> None:
        for d in done:
            if d.error is not None:
                frame = error_reply_of(d.req_id, d.error)
            else:
                frame = ok_reply(d.req_id, d.result)
            self.replies.send(d.reply_to + [frame])

    def _serve_clients(self) -> None:
        for _ in range(256):
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            envelope: list[bytes] = [frames[0].bytes]
            req_id = None
            try:
                envelope, body = split_request(frames)
                # with CURVE, the authenticator named the client (ROLE:NAME); without, it is local
                user = str(body.get("User-Id")) if self.auth is not None else None
                operator = user is None or role_of(user) == "operator"
                msg = unpack(body.bytes)
                req_id = request_id_of(msg)
                cmd, args = decode_replica_request(msg)
                # the client: its CURVE identity with --auth; else the connection
                client = user if user is not None else envelope[0]
                check_command(INFERENCE, user, cmd)
                if cmd == BLOB:
                    request = WireRequest(req_id or "", BLOB, validate(BLOB_ARGS, args, "args"))
                    if (refused := self.blob_server.submit(envelope, request)) is not None:
                        self.replies.send(envelope + [refused])
                    continue
                if cmd == GENERATE:
                    if self.engine is None:
                        raise ProtocolError("not_ready", "inference is disabled on this replica")
                    immediate = self.engine.submit(req_id or "", args, envelope, client=client)
                    if immediate is not None:
                        self._send([immediate])
                    continue
                if cmd == CANCEL:
                    # only the client that sent a request may cancel it
                    gone = None if self.engine is None else self.engine.cancel(
                        validate(CANCEL_ARGS, args, "args")["id"], client)
                    if gone is not None:
                        self._send([gone])
                    reply = ok_reply(req_id, {"cancelled": gone is not None})
                    self.replies.send(envelope + [reply])
                    continue
                reply = ok_reply(req_id, self._command(cmd, args, operator=operator))
            except ProtocolError as exc:
                reply = error_reply_of(req_id, exc)
            self.replies.send(envelope + [reply])

    def _command(self, cmd: str, raw_args: dict[str, Any], *, operator: bool) -> Any:
        if cmd == STATUS:
            validate({}, raw_args, "args")
            return self.status(details=operator)
        args = validate(SLOT_ARGS, raw_args, "args")
        pool = self.replica.pool
        if pool is None:
            raise ProtocolError("not_ready", "the pool is not configured yet")
        if not 0 <= args["slot"] < pool.spec.slots:
            raise ProtocolError("bad_request", f"args.slot must be below {pool.spec.slots}",
                                "args.slot")
        c = pool.read_slot(args["slot"])
        return {"scaling": c.scaling, "rank": c.rank,
                "A": {m: _array(a) for m, a in c.A.items()},
                "B": {m: _array(b) for m, b in c.B.items()}}


def _array(a: np.ndarray) -> dict[str, Any]:
    a = np.asarray(a, dtype=np.float32)
    return {"shape": list(a.shape), "dtype": "float32", "data": a.tobytes()}
