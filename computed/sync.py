"""The replica's sync thread: it follows statesvc and keeps the replica in step with the log.

It owns the SUB socket (diffs and heartbeats), the control client and a DEALER that
heartbeats to statesvc without ever blocking. Each turn it drains the diff stream into a
queue, applies what follows the applied seq, and catches up on a gap, on a heartbeat beyond
the applied seq or after 3 s of silence. A failed advance (statesvc down, a bad blob) keeps
the pool as it is and is retried. With several statesvc instances of one log (`--state a,b
--diffs c,d`), it follows one; after 3 s of silence it moves its SUB and its heartbeats to
the next and catches up by seq from its applied seq (the control client moves on its own),
so no event is lost or applied out of order.

When the replica applies events that are not the live tail (a bootstrap, a catch-up), it
fetches their blobs from peers first (`PeerList`, computed/residency/blob_cache.py).
"""
from __future__ import annotations

import logging
import random
import socket
import threading
import time
import uuid
from typing import Any

import zmq

from computed.replica import SAVE_EVERY_S, ForeignLog, GapError, Phase, Replica
from computed.residency.blob_cache import BlobError
from shared.client import ControlClient, RemoteError, Unavailable
from shared.config import HEARTBEAT_INTERVAL_S, MAX_WIRE_BYTES, REPLICA_SILENCE_S
from shared.endpoints import connect, split_addresses
from shared.events import Body, EventError
from shared.keys import ClientKeys
from shared.protocol import PUBLISHED_HEARTBEAT, ProtocolError, encode_request, unpack, validate
from shared.reducer import ReducerError, body_of_diff
from shared.threadname import name_os_thread

log = logging.getLogger("computed")

RETRY_S = 1.0
# the longest either loop sleeps when nothing arrives (idle wakeups cost each replica CPU, a
# fleet of them on a few cores adds up); a stop or a signal wakes them at once
IDLE_POLL_MS = 250
SYNC_ERRORS = (GapError, Unavailable, RemoteError, BlobError, ReducerError, EventError,
               ForeignLog)
PEER_LIST_TTL_S = 2.0  # statesvc's replica rows are read again after this
PEER_TIMEOUT_S = 1.0  # a peer that does not answer a chunk this fast is passed over ...
PEER_BACKOFF_S = 60.0  # ... and not asked again for this long (a refused key, a cut link)


class PeerList:
    """The fleet's other replicas to fetch a blob from (computed/residency/blob_cache.py `Peers`):
    statesvc's `status` rows, read at most every PEER_LIST_TTL_S, of ACTIVE replicas whose
    last heartbeat says they have applied the event that introduced the blob. In random
    order, so a fleet's new replicas spread their fetches over the holders. Under CURVE the
    replica connects with its own key (peers admit it from their key dir's replicas/) and
    expects the server key of its own --auth dir: a fleet's replicas share one."""

    def __init__(self, client: ControlClient, own_id: str, keys: ClientKeys | None) -> None:
        self.state_client, self.own_id, self.keys = client, own_id, keys
        self._rows: list[dict[str, Any]] = []
        self._read_at: float | None = None
        self._down: dict[str, float] = {}  # address -> monotonic time it may be asked again

    def candidates(self, version: int) -> list[str]:
        now = time.monotonic()
        if self._read_at is None or now - self._read_at > PEER_LIST_TTL_S:
            self._rows = list(self.state_client.call("status").get("replicas") or [])
            self._read_at = now
        rows = [r for r in self._rows if r.get("id") != self.own_id
                and r.get("state") == "ACTIVE" and isinstance(r.get("address"), str)
                and isinstance(r.get("applied_seq"), int) and r["applied_seq"] >= version
                and self._down.get(r["address"], 0.0) <= now]
        random.shuffle(rows)
        return [r["address"] for r in rows]

    def client(self, address: str) -> ControlClient:
        return ControlClient(address, timeout_s=PEER_TIMEOUT_S, retries=0, keys=self.keys)

    def passed_over(self, address: str) -> None:
        self._down[address] = time.monotonic() + PEER_BACKOFF_S


class SyncLoop(threading.Thread):
    """Keeps the replica in step with statesvc (see the module docstring)."""

    def __init__(self, replica: Replica, *, replica_id: str, listen: str, state: str,
                 diffs: str, heartbeat: bool = True, keys: ClientKeys | None = None) -> None:
        super().__init__(name="sync", daemon=True)
        self.keys = keys
        self.heartbeat = heartbeat
        self.replica = replica
        self.replica_id = replica_id
        self.listen = listen
        self.state_addrs, self.diffs_addrs = split_addresses(state), split_addresses(diffs)
        if len(self.state_addrs) != len(self.diffs_addrs):
            raise ValueError(f"{len(self.state_addrs)} control and {len(self.diffs_addrs)} diff "
                             "addresses: give one of each per statesvc instance")
        self.follow = 0  # the instance whose diff stream this replica follows now
        self.queue: dict[int, tuple[str | None, Body]] = {}  # seq -> (its log, the event)
        self.heard_at = time.monotonic()
        self.remote_head = 0
        self.next_sync = 0.0
        self.fatal: BaseException | None = None
        self.beat_refused = ""  # statesvc's last refusal of a heartbeat, to log it once
        self.silences = 0  # times the sockets were opened anew since the diff stream last spoke
        self.stopping = threading.Event()
        self._wake, self._waker = socket.socketpair()  # `stop` ends the poll at once

    @property
    def state_addr(self) -> str:
        return self.state_addrs[self.follow]

    @property
    def diffs_addr(self) -> str:
        return self.diffs_addrs[self.follow]

    def stop(self) -> None:
        self.stopping.set()
        try:
            self._waker.send(b"\0")
        except OSError:
            pass

    def _open(self) -> None:
        """The SUB and the heartbeat DEALER, connected to the followed instance."""
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, 1_000_000)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.beat = ctx.socket(zmq.DEALER)
        if self.keys is not None:
            self.keys.apply(self.sub)
            self.keys.apply(self.beat)
        connect(self.sub, self.diffs_addr)  # subscribe first (Clone pattern), then fetch state
        self.beat.setsockopt(zmq.LINGER, 0)
        self.beat.setsockopt(zmq.SNDHWM, 4)
        connect(self.beat, self.state_addr)
        self.poller = zmq.Poller()
        self.poller.register(self.sub, zmq.POLLIN)
        self.poller.register(self.beat, zmq.POLLIN)
        self.poller.register(self._wake, zmq.POLLIN)

    def _move_on(self) -> None:
        """The followed instance is silent: follow the next one, or with one instance open
        its sockets anew (libzmq stops redialling a server that refused our CURVE key, so a
        key put back would otherwise never be tried). What was published in between is read
        by seq (the queue keeps what arrived; a gap is fetched). Said once a silence."""
        self.sub.close(0)
        self.beat.close(0)
        old = self.diffs_addr
        self.follow = (self.follow + 1) % len(self.diffs_addrs)
        self._open()
        if self.silences == 0:
            log.warning("no word from statesvc at %s for %g s: %s %s / %s", old,
                        REPLICA_SILENCE_S, "following" if len(self.diffs_addrs) > 1 else
                        "reconnecting to", self.state_addr, self.diffs_addr)
        self.silences += 1

    def run(self) -> None:
        name_os_thread()
        self._open()
        next_beat = 0.0
        try:
            while not self.stopping.is_set():
                ready = dict(self.poller.poll(IDLE_POLL_MS))
                if self.sub in ready:
                    self._drain_sub()
                if self.beat in ready:
                    while self.beat.poll(0):
                        self._beat_reply(self.beat.recv())
                self._sync()
                self.replica.save_local_state(every_s=SAVE_EVERY_S)
                if self.heartbeat and time.monotonic() >= next_beat:
                    self._heartbeat()
                    next_beat = time.monotonic() + HEARTBEAT_INTERVAL_S
        except BaseException as exc:  # a model mismatch, or a bug: the daemon must stop
            self.fatal = exc
        finally:
            try:  # what the last turns applied, so that a restart starts from it
                self.replica.save_local_state()
            except OSError as exc:
                log.warning("could not save the local state: %s", exc)
            self.sub.close(0)
            self.beat.close(0)
            self._wake.close()
            self._waker.close()

    def _drain_sub(self) -> None:
        r = self.replica
        while True:
            try:
                topic, frame = self.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except ValueError:
                continue  # not two frames
            self.heard_at = time.monotonic()
            if self.silences:
                log.info("the diff stream from %s speaks again", self.diffs_addr)
                self.silences = 0
            try:
                msg = unpack(frame, max_bytes=MAX_WIRE_BYTES)
                if topic == b"hb":
                    hb = validate(PUBLISHED_HEARTBEAT, msg, "hb")
                    r.check_log(hb["log_id"])
                    self.remote_head = max(self.remote_head, hb["head_seq"])
                elif topic == b"diff":
                    seq, body = body_of_diff(msg)
                    r.check_log(msg.get("log_id"))
                    self.remote_head = max(self.remote_head, seq)
                    if seq > r.applied_seq:
                        self.queue[seq] = (msg.get("log_id"), body)
            except (ProtocolError, EventError) as exc:
                log.warning("dropped a malformed %r message on the diff stream: %s", topic[:16],
                            exc)
            except ForeignLog as exc:
                self._failed(exc)

    def _sync(self) -> None:
        r = self.replica
        now = time.monotonic()
        try:
            if r.phase is not Phase.ACTIVE:
                if now >= self.next_sync:
                    self.next_sync = now + RETRY_S
                    r.bootstrap()
                    log.info("ACTIVE at seq %d", r.applied_seq)
                return
            try:
                self._apply_queue()
            except GapError as exc:
                log.info("gap in the diff stream (%s): fetching the missing range", exc)
                self.next_sync = 0.0
            behind = self.remote_head > r.applied_seq or bool(self.queue)
            silent = now - self.heard_at > REPLICA_SILENCE_S
            if silent:
                self._move_on()
                self.heard_at = now  # give the next one (or the new sockets) a whole period
            if (behind or silent) and now >= self.next_sync:
                self.next_sync = now + RETRY_S
                if r.catch_up():
                    log.info("caught up to seq %d", r.applied_seq)
                if silent:
                    self.heard_at = now  # statesvc answered: wait another period
                self._apply_queue()
        except SYNC_ERRORS as exc:
            self._failed(exc)

    def _failed(self, exc: Exception) -> None:
        """The replica's last_error, logged when it changes."""
        if str(exc) != self.replica.last_error:
            log.warning("sync: %s", exc)
        self.replica.last_error = str(exc)

    def _apply_queue(self) -> None:
        r = self.replica
        for seq in [s for s in self.queue if s <= r.applied_seq]:
            del self.queue[seq]  # duplicates, and what a catch-up already applied
        run: list[tuple[int, Body]] = []
        log_id = None
        seq = r.applied_seq + 1
        while seq in self.queue and (not run or self.queue[seq][0] == log_id):
            log_id, body = self.queue[seq]
            run.append((seq, body))
            seq += 1
        if run:
            r.apply_events(run, log_id=log_id)
            for s, _ in run:
                self.queue.pop(s, None)
        if self.queue:  # something newer than what follows: a gap
            raise GapError(r.applied_seq + 1, min(self.queue))

    def _beat_reply(self, frame: bytes) -> None:
        """Say once why statesvc refuses our heartbeats (an id another replica holds, ...)."""
        try:
            reply = unpack(frame, max_bytes=MAX_WIRE_BYTES)
        except ProtocolError:
            return
        error = reply.get("error") if isinstance(reply, dict) else None
        refused = f"{error.get('code')}: {error.get('message')}" if isinstance(error, dict) else ""
        if refused and refused != self.beat_refused:
            log.warning("statesvc refuses this replica's heartbeat (%s)", refused)
        self.beat_refused = refused

    def _heartbeat(self) -> None:
        args = {"id": self.replica_id, "address": self.listen, **digests(self.replica)}
        try:
            self.beat.send(encode_request(uuid.uuid4().hex, "heartbeat", args), zmq.NOBLOCK)
        except zmq.Again:
            pass  # statesvc is away; the next one will do


def digests(r: Replica) -> dict[str, Any]:
    return {"state": r.phase.value, "applied_seq": r.applied_seq,
            "logical_digest": r.logical_digest(), "pool_digest": r.pool_digest()}

