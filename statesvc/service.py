"""The state service's core: commands in, events out, no sockets.

`StateService.handle` takes a batch of decoded requests (all that arrived
together), validates each write against the state that the writes before it
leave, appends all resulting events in one durable transaction (group commit),
and answers each request. Reads that follow a write in the same batch see it.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import msgpack

from shared.blobserve import read_chunk
from shared.config import DEFAULT_SNAPSHOT_EVERY, MAX_ADAPTER_BYTES, MAX_REPLICAS
from shared.errors import CodedError, cause
from shared.events import AdapterLoaded, Event, EventError, encode_body, log_id_of
from shared.protocol import WRITE_COMMANDS, Request
from shared.reducer import (State, apply, canonical, logical_digest, snapshot_bytes,
                            verified_snapshot)
from statesvc.decisions import DECISIONS, CommandError, Context, storage_error
from statesvc.persistence.base import (CATCH_UP_PAGE, UNAVAILABLE, BlobStore, EventStore,
                                       HeadMoved, NewBlob, NewEvent, Snapshot)
from statesvc.registry import Registry
from statesvc.views import list_page, result_of

log = logging.getLogger("statesvc")

# the reads whose results carry `log_id`: all but `blob` (content-addressed, the same bytes in
# every log) and `heartbeat` (the replica learns the log from the diff stream and catch-up)
LOG_READS = frozenset({"list", "events", "snapshot", "digest", "status"})
RECENT_HEADS = 256  # heads whose digests `status` compares replicas with
HEAD_MOVED_RETRIES = 16  # a shared log: times a batch is decided again before it gives up


def _event_ids(requests: list[tuple[Request, str]]) -> list[str]:
    """The event_ids of the requests that append events (looked up before they are decided)."""
    return [r.args["event_id"] for r, _ in requests if r.cmd in DECISIONS]


@dataclass
class Answer:
    result: Any = None
    error: CommandError | None = None


@dataclass
class _Batch:
    """Writes decided but not yet committed."""

    state: State
    events: list[NewEvent] = field(default_factory=list)
    blobs: list[NewBlob] = field(default_factory=list)
    new_blob_files: list[str] = field(default_factory=list)
    snapshots: list[Snapshot] = field(default_factory=list)
    # event_id -> (event type, result): recorded before, or decided in this batch
    by_event_id: dict[str, tuple[str, dict[str, Any]]] = field(default_factory=dict)
    decided_ids: list[str] = field(default_factory=list)
    answers: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    # every write answered in this batch: if the commit fails, none of them may claim success
    writers: list[int] = field(default_factory=list)


class StateService:
    def __init__(self, store: EventStore, blobs: BlobStore, *,
                 snapshot_every: int = DEFAULT_SNAPSHOT_EVERY,
                 max_adapter_bytes: int = MAX_ADAPTER_BYTES,
                 adapter_roots: tuple[Path, ...] = (),
                 max_replicas: int = MAX_REPLICAS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.blobs = blobs
        self.snapshot_every = snapshot_every
        self.max_adapter_bytes = max_adapter_bytes
        self.adapter_roots = adapter_roots  # empty: anywhere
        self.clock = clock
        # called now and then while a load reads and checks large weights: the server
        # publishes its due heartbeats from it (one thread: it cannot from anywhere else)
        self.progress: Callable[[], None] = lambda: None
        self.registry = Registry(max_replicas=max_replicas, clock=clock)
        self._digests: OrderedDict[int, str] = OrderedDict()
        # the last RECENT_HEADS heads, digested when first asked: `status` never rebuilds
        self._heads: OrderedDict[int, State | str] = OrderedDict()
        self.state = self.rebuild()
        genesis = store.read(0, 1)
        self.log_id = log_id_of(genesis[0]) if genesis else None  # docs/protocol.md §9b
        self._remember_head()
        self._sweep_blobs()
        missing = [a.name for a in self.state.adapters.values() if not blobs.has(a.sha256)]
        if missing:
            log.error("blobs missing for loaded adapters %s; replicas cannot fetch them", missing)

    def _sweep_blobs(self) -> None:
        """Delete the blobs no event refers to (left by a crash between blob and event) and
        temp files, but only where the store's high-water mark shows that the log holds every
        event it held before (the store refuses to open one behind it): a log that lost events
        would take every blob of theirs for an orphan. Blobs in a log are never orphans."""
        if self.blobs.in_log:
            return
        # recorded_head None: a data dir from before high-water marks
        orphans = self.blobs.sweep(self.store.blob_hashes(),
                                   log_complete=self.store.recorded_head is not None)
        if orphans:
            log.warning("removed %d blob(s) no event refers to: %s", len(orphans),
                        ", ".join(o[:12] for o in orphans))

    # ---- state ---------------------------------------------------------------

    def rebuild(self, *, until: int | None = None, use_snapshot: bool = True) -> State:
        """The state at `until` (default: head) from the latest snapshot before it and the tail."""
        snap = self.store.latest_snapshot(until) if use_snapshot else None
        try:
            state = State() if snap is None else verified_snapshot(
                snap.seq, msgpack.unpackb(snap.state), snap.digest)
        except EventError as exc:
            raise RuntimeError(str(exc)) from None
        while True:
            page = self.store.read(state.seq, 1000, until=until)
            if not page:
                return state
            for ev in page:
                state = apply(state, ev.seq, ev.body)

    def catch_up(self, page: list[Event] | None = None) -> list[Event]:
        """Apply (and return) the events other instances appended to a shared log since;
        `page`: the first page of them, already read (a turn's start)."""
        new: list[Event] = []
        page = self.store.read(self.state.seq, CATCH_UP_PAGE) if page is None else page
        while page:
            state = self.state
            for ev in page:
                state = apply(state, ev.seq, ev.body)
            self.state = state
            new += page
            full = len(page) == CATCH_UP_PAGE  # else the head was reached: no read for nothing
            page = self.store.read(self.state.seq, CATCH_UP_PAGE) if full else []
        if new:
            if self.log_id is None:
                self.log_id = log_id_of(self.store.read(0, 1)[0])
            self._remember_head()
        return new

    def _remember_head(self) -> None:
        self._heads[self.state.seq] = self.state
        while len(self._heads) > RECENT_HEADS:
            self._heads.popitem(last=False)

    def head_digest(self, seq: int) -> str | None:
        """The digest at `seq` if it was one of the recent heads, else None (never rebuilt)."""
        known = self._heads.get(seq)
        if isinstance(known, State):
            known = self._heads[seq] = logical_digest(known)
        return known

    def digest_at(self, seq: int) -> str:
        recent = self.head_digest(seq)
        if recent is not None:
            return recent
        if seq not in self._digests:
            state = self.state if seq == self.state.seq else self.rebuild(until=seq)
            self._digests[seq] = logical_digest(state)
            while len(self._digests) > 4096:
                self._digests.popitem(last=False)
        return self._digests[seq]

    # ---- the batch -----------------------------------------------------------

    def handle(self, requests: list[tuple[Request, str]], *,
               more: Callable[[], list[tuple[Request, str]]] | None = None,
               ) -> tuple[list[Answer], list[Event]]:
        """Answer a batch of (request, actor); returns the answers and the committed events.

        `more`, when given, is asked for requests that arrived meanwhile before writes are
        committed; they join the batch (and its commit) and are answered after the others.

        On a shared log (PostgreSQL) the batch is decided on the caught-up head, again if
        another instance appended first; the others' events are returned too, in seq order."""
        requests = list(requests)
        committed: list[Event] = []
        if all(req.cmd == "heartbeat" for req, _ in requests):
            # the registry alone: no turn, no catch-up (no database round trip), so a fleet's
            # heartbeats cost a shared log nothing; the head they are told is the one read
            # at the last batch or CATCH_UP_S tick (statesvc/server.py)
            return self._handle(requests, committed, None, {}), committed
        why = "other statesvc instances kept appending"
        for _ in range(HEAD_MOVED_RETRIES):
            with ExitStack() as turn:
                try:  # the turn starts with the catch-up and the event_ids' lookup
                    begun = turn.enter_context(self.store.turn(self.state.seq,
                                                               _event_ids(requests)))
                    committed += self.catch_up(begun.events) if self.store.shared else []
                except Exception as exc:  # the log could not be read: nothing decided
                    log.warning("catching up with the log failed: %s", exc)
                    why = f"the log could not be read ({cause(exc)})"
                    break
                try:
                    return self._handle(requests, committed, more, begun.recorded), committed
                except HeadMoved as moved:
                    log.info("another statesvc appended up to seq %d: deciding again",
                             moved.head)
        return [Answer(error=storage_error(why, write=req.cmd in WRITE_COMMANDS))
                for req, _ in requests], committed

    def _handle(self, requests: list[tuple[Request, str]], committed: list[Event],
                more: Callable[[], list[tuple[Request, str]]] | None,
                recorded: dict[str, Event]) -> list[Answer]:
        answers = [Answer() for _ in requests]
        known: dict[str, tuple[str, dict[str, Any]]] = {}  # event_ids recorded or decided
        self._remember(recorded, known)
        batch = _Batch(self.state, by_event_id=known)
        i = 0
        try:
            while i < len(requests) or (more is not None and batch.events
                                        and self._extend(requests, answers, known, more)):
                req, actor = requests[i]
                try:
                    if req.cmd in DECISIONS:
                        self._write(batch, i, req, actor, answers)
                    else:
                        if batch.events:
                            committed += self._commit(batch, answers)
                            batch = _Batch(self.state, by_event_id=known)
                        answers[i].result = self._with_log_id(req.cmd, self._read(req, actor))
                except (HeadMoved, *UNAVAILABLE):  # nothing of this batch written: below
                    raise
                except CommandError as exc:
                    answers[i].error = exc
                except CodedError as exc:  # the reducer's, the adapter checks', the blob store's
                    answers[i].error = CommandError(exc.code, str(exc), exc.field)
                except Exception as exc:  # a bug must cost one answer, never the service
                    log.exception("internal error on %s", req.cmd)
                    answers[i].error = CommandError("internal_error", f"internal error "
                                                    f"({type(exc).__name__}: {exc}); nothing "
                                                    "was recorded for this command; please "
                                                    "report it")
                i += 1
            if batch.events:
                committed += self._commit(batch, answers)
        except UNAVAILABLE as lost:  # the database went away while deciding: retryable
            # the writes decided since the last commit and every request not reached yet: none
            # was recorded by this batch; the answers before them (reads, earlier commits) hold
            log.warning("the log could not be read while deciding a batch: %s", lost)
            for j in [*batch.writers, *range(i, len(requests))]:
                if answers[j].error is None:
                    answers[j].result = None
                    answers[j].error = storage_error(
                        f"the log could not be read ({cause(lost)})",
                        write=requests[j][0].cmd in WRITE_COMMANDS)
        return answers

    @staticmethod
    def _remember(recorded: dict[str, Event],
                  known: dict[str, tuple[str, dict[str, Any]]]) -> None:
        for eid, ev in recorded.items():
            known.setdefault(eid, (ev.type, result_of(ev.type, ev.seq, ev.body)))

    def _extend(self, requests: list[tuple[Request, str]], answers: list[Answer],
                known: dict[str, tuple[str, dict[str, Any]]],
                more: Callable[[], list[tuple[Request, str]]]) -> bool:
        """Append the requests `more` has now to the batch; False when it has none."""
        extra = more()
        if not extra:
            return False
        requests += extra  # taken off the socket: answered whatever the lookup meets
        answers += [Answer() for _ in extra]
        self._remember(self.store.by_event_ids(_event_ids(extra)), known)
        return True

    def _commit(self, batch: _Batch, answers: list[Answer]) -> list[Event]:
        try:
            events = self.store.append(batch.events, blobs=batch.blobs,
                                       snapshots=batch.snapshots)
        except HeadMoved:
            raise
        except Exception as exc:  # the disk or the database failed
            log.exception("append failed")
            for sha in batch.new_blob_files:
                if sha not in self.store.blob_hashes():
                    self.blobs.remove(sha)
            for event_id in batch.decided_ids:
                del batch.by_event_id[event_id]
            # a connection lost during COMMIT leaves its outcome unknown: the state stays as
            # it was, and the retry finds the event in the log (by event_id) if it committed
            outcome = ("it may have been recorded if the connection was lost while committing"
                       if self.store.shared else "nothing was recorded")
            for i in (i for i in batch.writers if answers[i].error is None):
                answers[i].result = None
                answers[i].error = storage_error(f"the event could not be stored ({cause(exc)}); "
                                                  f"{outcome}")
            return []
        for blob in batch.blobs:  # the fleet fetches them next
            if blob.data is not None:
                self.blobs.committed(blob.sha256, blob.data)
        self.state = batch.state
        if self.log_id is None and events and events[0].seq == 1:  # the genesis names the log
            self.log_id = log_id_of(events[0])
        self._remember_head()
        for i, result in batch.answers:
            answers[i].result = result
        return events

    def _write(self, batch: _Batch, i: int, req: Request, actor: str,
               answers: list[Answer]) -> None:
        args = req.args
        batch.writers.append(i)
        event_id = args["event_id"]
        prior = batch.by_event_id.get(event_id)
        if prior is not None:  # a retry: answer with the original result, record nothing
            if prior[0] != DECISIONS[req.cmd].event or prior[1].get("name") != args.get("name"):
                raise CommandError("conflict", f"event_id {event_id} was already used by a "
                                   f"different command ({prior[0]} at seq {prior[1]['seq']}); "
                                   "use a new event_id", "args.event_id")
            answers[i].result = prior[1]
            return
        state = batch.state
        if args["expect_head"] is not None and args["expect_head"] != state.seq:
            raise CommandError("conflict", f"the head is at seq {state.seq}, not "
                               f"{args['expect_head']}; re-read the state and retry",
                               "args.expect_head")
        seq = state.seq + 1
        decided = DECISIONS[req.cmd].decide(state, seq, args, Context(
            self.blobs, self.adapter_roots, self.max_adapter_bytes, self.progress))
        if isinstance(decided, dict):  # nothing changes: the state already is what was asked
            answers[i].result = decided
            return
        body, blob = decided
        new_state = apply(state, seq, body)
        if isinstance(body, AdapterLoaded):
            in_log = self.blobs.in_log  # written in the event's transaction
            if blob is not None and not in_log:  # None: the blob store already holds these bytes
                sha, created = self.blobs.put(blob, body.sha256, progress=self.progress)
                if created:
                    batch.new_blob_files.append(sha)
            batch.blobs.append(NewBlob(body.sha256, body.size, seq, blob if in_log else None))
        batch.state = new_state
        batch.events.append(NewEvent(seq, event_id, body.TYPE, encode_body(body), actor))
        result = result_of(body.TYPE, seq, body)
        batch.by_event_id[event_id] = (body.TYPE, result)
        batch.decided_ids.append(event_id)
        batch.answers.append((i, result))
        if self.snapshot_every and seq % self.snapshot_every == 0:
            batch.snapshots.append(Snapshot(seq, snapshot_bytes(new_state),
                                            logical_digest(new_state)))

    # ---- reads ---------------------------------------------------------------

    def _with_log_id(self, cmd: str, result: Any) -> Any:
        """Reads that describe the log say which log it is (docs/protocol.md §9b)."""
        if cmd in LOG_READS:
            result["log_id"] = self.log_id
        return result

    def _read(self, req: Request, actor: str) -> Any:
        args, state = req.args, self.state
        if req.cmd == "list":
            return list_page(self.state, args.get("after"), args["limit"])
        if req.cmd == "events":
            events = self.store.read(args["since"], args["limit"])
            return {"head_seq": state.seq, "events": [e.to_wire() for e in events]}
        if req.cmd == "snapshot":
            snap = self.store.latest_snapshot()
            if snap is None:
                return {"seq": 0, "head_seq": state.seq, "digest": logical_digest(State()),
                        "state": canonical(State())}
            return {"seq": snap.seq, "head_seq": state.seq, "digest": snap.digest,
                    "state": msgpack.unpackb(snap.state)}
        if req.cmd == "digest":
            if args["seq"] > state.seq:
                raise CommandError("not_found", f"seq {args['seq']} is beyond the head "
                                   f"{state.seq}", "args.seq")
            return {"seq": args["seq"], "digest": self.digest_at(args["seq"])}
        if req.cmd == "blob":
            return self.blob(args)
        if req.cmd == "heartbeat":
            self.registry.heartbeat(args, actor)
            return {"head_seq": state.seq}
        if req.cmd == "status":
            return self.status()
        raise CommandError("unknown_command", f"unknown command {req.cmd!r}")

    def blob(self, args: dict[str, Any]) -> dict[str, Any]:
        return read_chunk(self.blobs, args)

    def status(self) -> dict[str, Any]:
        """Head, digest and every replica; costs what the registry's size costs (registry.py)."""
        head = self.state.seq
        return {"head_seq": head, "digest": self.digest_at(head),
                "replicas": self.registry.rows(head, self.head_digest)}
