"""The gateway's view of the fleet, followed from statesvc, and the choice of a replica.

A poller thread reads statesvc's `status` (replicas) and `list` (the registry: each adapter's
version is the seq of its load, its sha256 and scaling its prefix root) and each live
replica's own `status` (queue and resident set, host tier, per-adapter requests and the
prefixes its prefix cache holds) every `interval_s`. A request goes to an ACTIVE replica that
agrees with the log and has applied at least the adapter's load seq (`min_seq`), preferring
one where the adapter is resident in a slot, then one that holds it in its host tier (parsed:
a slot write away), then, among those queued at most `prefix_slack` more than the least
queued of that tier, the one holding the longest prefix of the prompt, then the fewest queued
requests (its last status plus what this gateway has sent it since); when none has applied
that seq yet, any ACTIVE agreeing replica, which waits for it. docs/gateway.md "Routing"
writes the score down.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Sequence

from shared.client import ControlClient, RemoteError, Unavailable, list_adapters
from shared.config import DEFAULT_PREFIX_SLACK
from shared.keys import ClientKeys
from shared.prefix import BASE_ROOT, BLOCK_TOKENS, SUMMARY_LIMIT, block_hashes, content_root, summary_depths
from shared.replica_protocol import STATUS
from shared.threadname import name_os_thread

log = logging.getLogger("computed.gateway")



@dataclass(frozen=True)
class PrefixCache:
    """A replica's prefix cache at its last status (docs/protocol.md §13b `prefix_cache`)."""

    capacity_blocks: int
    used_blocks: int
    lookups: int  # since the replica started, as the two token counts
    hit_tokens: int  # prompt tokens whose KV the cache held
    prompt_tokens: int  # prompt tokens looked up
    # the chain hashes (shared/prefix.py) of the prefixes it holds, at the summary depths; empty
    # when its blocks are not BLOCK_TOKENS long (hashes the gateway cannot make)
    held: frozenset[str] = frozenset()


@dataclass(frozen=True)
class ReplicaView:
    id: str
    address: str
    applied_seq: int
    queued: int  # running + waiting at its last status
    resident: frozenset[str]  # adapter names in its slots
    max_len: int
    host: frozenset[str] = frozenset()  # adapter names in its host tier (parsed weights)
    # adapter name -> (requests running on it, requests waiting for it) at its last status
    requests: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    prefix: PrefixCache | None = None  # None: its prefix cache is off (or not reported)
    # requests one client may have waiting or running there (--client-queue-limit); None:
    # not reported (an older replica)
    client_limit: int | None = None

    def tier(self, adapter: str | None) -> int:
        """Where `adapter` is on this replica, best first: 0 in a slot (or the base model), 1 in
        the host tier only, 2 neither (its weights are fetched and parsed first)."""
        if adapter is None or adapter in self.resident:
            return 0
        return 1 if adapter in self.host else 2


@dataclass(frozen=True)
class PromptKeys:
    """A prompt's chain hashes under its adapter's root at the summary depths, deepest first,
    made once for all the candidates of a request."""

    depths: tuple[tuple[int, str], ...]

    @staticmethod
    def of(root: str, tokens: Sequence[int]) -> PromptKeys:
        depths = summary_depths(len(tokens) // BLOCK_TOKENS)
        chain = block_hashes(root, tokens, blocks=depths[-1]) if depths else []
        return PromptKeys(tuple((d, chain[d - 1]) for d in reversed(depths)))

    def held_by(self, r: ReplicaView) -> int:
        """The leading tokens of the prompt whose KV `r` holds, to its summary's resolution
        (shared/prefix.py `matched_tokens`)."""
        held = r.prefix.held if r.prefix is not None else frozenset()
        return next((d * BLOCK_TOKENS for d, h in self.depths if h in held), 0)


def rank(pool: Sequence[ReplicaView], adapter: str | None, queued: Mapping[str, int],
         prompt: PromptKeys | None, slack: int) -> list[ReplicaView]:
    """`pool` best first for a request on `adapter` (docs/gateway.md, Routing): by tier; then,
    among the replicas queued at most `slack` more than the least queued of their tier, the
    longest prefix of the prompt held (`prompt` None: none known); then the fewest queued
    (`queued`: address -> requests); then the id."""
    least: dict[int, int] = {}
    for r in pool:
        t = r.tier(adapter)
        least[t] = min(least.get(t, queued[r.address]), queued[r.address])

    def key(r: ReplicaView) -> tuple[int, int, int, str]:
        t, q = r.tier(adapter), queued[r.address]
        held = prompt.held_by(r) if prompt is not None and q <= least[t] + slack else 0
        return (t, -held, q, r.id)
    return sorted(pool, key=key)


@dataclass
class FleetView:
    """What the last poll saw; replaced whole, never changed in place."""

    ok: bool = False  # statesvc answered the last poll
    error: str = "no answer from statesvc yet"
    head_seq: int = 0
    pool: dict[str, Any] | None = None
    adapters: dict[str, int] = field(default_factory=dict)  # name -> version (= load seq)
    # name -> its version's prefix root (shared/prefix.py `content_root`); none for a version
    # this gateway loaded until a poll lists it
    roots: dict[str, str] = field(default_factory=dict)
    replicas: tuple[ReplicaView, ...] = ()
    # replicas ACTIVE and agreeing but still compiling (status `inference.state` "warming"):
    # routed nothing until they are ready; a request that finds no ready replica waits for them
    warming: tuple[str, ...] = ()


def _with(view: FleetView, learned: dict[str, tuple[int | None, int]]) -> FleetView:
    if not learned:
        return view
    adapters = dict(view.adapters)
    roots = {n: r for n, r in view.roots.items() if n not in learned}
    for name, (version, _) in learned.items():
        if version is None:
            adapters.pop(name, None)
        else:
            adapters[name] = version
    return FleetView(ok=view.ok, error=view.error, head_seq=view.head_seq, pool=view.pool,
                     adapters=adapters, roots=roots, replicas=view.replicas)


class Router:
    def __init__(self, state: str, *, interval_s: float = 0.5, timeout_s: float = 2.0,
                 keys: ClientKeys | None = None, replica_keys: ClientKeys | None = None,
                 prefix_slack: int = DEFAULT_PREFIX_SLACK) -> None:
        if prefix_slack < 0:
            raise ValueError(f"prefix_slack {prefix_slack} is below 0 (--prefix-slack)")
        self.state = state
        self.keys = keys  # the gateway's CURVE identity on statesvc (None: no --auth there)
        self.replica_keys = replica_keys  # ... and on the replicas' listen sockets
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.prefix_slack = prefix_slack
        self.view = FleetView()
        # replica address -> adapter (None: the base model) -> requests sent and unanswered
        self._inflight: dict[str, dict[str | None, int]] = {}
        self._lock = threading.Lock()
        # what this gateway wrote (name -> (version or None when unloaded, seq)), shown
        # until a poll reaches that seq: a poll that began before the write must not undo it
        self._learned: dict[str, tuple[int | None, int]] = {}
        # replicas a request found gone (unreachable, or the connection dropped): not
        # candidates until their own status answers again
        self._failed: set[str] = set()
        self._stop = threading.Event()
        self._polled = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gateway-poll", daemon=True)
        # connections kept from poll to poll (a client drops its socket after a silence and
        # connects again on its next call): a poll costs two round trips, not two handshakes
        self._state_client = ControlClient(state, timeout_s=timeout_s, retries=0, keys=keys)
        self._replica_clients: dict[str, ControlClient] = {}

    def start(self) -> Router:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for c in [self._state_client, *self._replica_clients.values()]:
            c.close()

    def wait_polled(self, timeout: float) -> bool:
        return self._polled.wait(timeout)

    def refresh(self) -> None:
        """Poll now (the poller does it every interval_s)."""
        view = self._poll()
        with self._lock:
            self._learned = {n: vs for n, vs in self._learned.items() if vs[1] > view.head_seq}
            self.view = _with(view, self._learned)
        self._polled.set()

    def learn(self, name: str, version: int | None, seq: int) -> None:
        """Show a load (version) or an unload (None) this gateway recorded at `seq` now."""
        with self._lock:
            self._learned[name] = (version, seq)
            self.view = _with(self.view, {name: (version, seq)})

    def _run(self) -> None:
        name_os_thread()
        while not self._stop.is_set():
            try:
                self.refresh()
            except Exception as exc:  # the poller must outlive anything one poll meets
                log.warning("poll failed: %s", exc)
            self._stop.wait(self.interval_s)

    def _poll(self) -> FleetView:
        try:
            status = self._state_client.call("status")
            first, adapters = list_adapters(self._state_client)
        except (Unavailable, RemoteError) as exc:
            return FleetView(ok=False, error=f"statesvc at {self.state}: {exc}",
                             replicas=self.view.replicas, adapters=self.view.adapters,
                             roots=self.view.roots,
                             pool=self.view.pool, head_seq=self.view.head_seq)
        views, warming = [], []
        before = {v.address: v for v in self.view.replicas}
        listed = {r.get("address") for r in status.get("replicas", [])}
        for gone in set(self._replica_clients) - listed:
            self._replica_clients.pop(gone).close()
        for r in status.get("replicas", []):
            if r.get("state") != "ACTIVE" or r.get("agrees") is not True:
                continue
            own = self._replica_status(r["address"])
            if own is None:
                # no answer in time: a replica busy compiling or under load stays as last
                # seen, unless a request found it gone (then it is out until it answers)
                with self._lock:
                    kept = before.get(r["address"]) if r["address"] not in self._failed else None
                if kept is not None:
                    views.append(kept)
                continue
            with self._lock:
                self._failed.discard(r["address"])
            if own.get("state") != "ACTIVE" or not own.get("inference"):
                continue
            if isinstance(own["inference"], dict) and own["inference"].get("warm") is False:
                warming.append(str(r.get("id", r["address"])))
                continue
            try:
                views.append(_replica_view(r, own))
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                # one replica's malformed status leaves it out, not the whole fleet's poll
                log.warning("replica %s: unreadable status (%r); not routed to", r.get("address"), exc)
        return FleetView(ok=True, error="", head_seq=int(status["head_seq"]),
                         pool=first.get("pool"),
                         adapters={a["name"]: int(a["version"]) for a in adapters},
                         roots={a["name"]: content_root(a["sha256"], a["scaling"])
                                for a in adapters},
                         replicas=tuple(sorted(views, key=lambda v: v.id)), warming=tuple(sorted(warming)))

    def _replica_status(self, address: str) -> dict[str, Any] | None:
        c = self._replica_clients.get(address)
        if c is None:
            c = self._replica_clients[address] = ControlClient(
                address, timeout_s=self.timeout_s, retries=0, keys=self.replica_keys)
        try:
            res = c.call(STATUS)
            return res if isinstance(res, dict) else None
        except (Unavailable, RemoteError):
            return None

    def candidates(self, adapter: str | None, min_seq: int,
                   exclude: frozenset[str] = frozenset(), *,
                   tokens: Sequence[int] = ()) -> list[ReplicaView]:
        """The replicas to try for a request on `adapter` whose prompt is `tokens`, best first
        (`rank`). The prompt is hashed once a call, and only when a candidate reports a
        prefix cache and the adapter's root is known."""
        with self._lock:
            view = self.view
            replicas = [r for r in view.replicas
                        if r.address not in exclude and r.address not in self._failed]
            queued = {r.address: r.queued + sum(self._inflight.get(r.address, {}).values())
                      for r in replicas}
        caught_up = [r for r in replicas if r.applied_seq >= min_seq]
        pool = caught_up or replicas  # none has it yet: one that will wait for min_seq
        root = BASE_ROOT if adapter is None else view.roots.get(adapter)
        prompt = None
        if root is not None and any(r.prefix is not None and r.prefix.held for r in pool):
            prompt = PromptKeys.of(root, tokens)
        return rank(pool, adapter, queued, prompt, self.prefix_slack)

    def routable(self) -> tuple[ReplicaView, ...]:
        """The replicas a request may be sent to now: the last poll's, less those a request
        has found gone since (`failed`). /health reports these."""
        with self._lock:
            return tuple(r for r in self.view.replicas if r.address not in self._failed)

    def failed(self, address: str) -> None:
        """A request found this replica gone: no more requests until its status answers."""
        with self._lock:
            self._failed.add(address)

    def sent(self, address: str, adapter: str | None, delta: int) -> None:
        """Count a request sent to a replica (delta 1) or answered there (-1)."""
        with self._lock:
            counts = self._inflight.setdefault(address, {})
            counts[adapter] = counts.get(adapter, 0) + delta
            if not counts[adapter]:
                del counts[adapter]

    def inflight(self, address: str) -> dict[str | None, int]:
        with self._lock:
            return dict(self._inflight.get(address, {}))


def _replica_view(listed: dict[str, Any], own: dict[str, Any]) -> ReplicaView:
    """A replica as statesvc lists it (`listed`) and as its own status shows it (`own`)."""
    inf = own["inference"]
    resident = frozenset(h["name"] for h in (own.get("slots") or {}).values()
                         if isinstance(h, dict) and "name" in h)
    return ReplicaView(
        id=str(listed["id"]), address=str(listed["address"]),
        applied_seq=max(int(listed["applied_seq"]), int(own.get("applied_seq", 0))),
        queued=int(inf["running"]) + int(inf["waiting"]), resident=resident,
        max_len=int(inf["max_len"]), host=_host_tier(own),
        requests=_adapter_requests(own), prefix=_prefix_cache(own),
        client_limit=int(inf["client_limit"]) if "client_limit" in inf else None)


def _host_tier(status: dict[str, Any]) -> frozenset[str]:
    """The adapter names in a replica status's `host_tier` (absent from a replica that does
    not report it: none)."""
    return frozenset(e["name"] for e in status.get("host_tier") or []
                     if isinstance(e, dict) and isinstance(e.get("name"), str))


def _prefix_cache(status: dict[str, Any]) -> PrefixCache | None:
    """A replica status's `prefix_cache` (null, or absent from a replica that does not report
    it: None)."""
    got = status.get("prefix_cache")
    if not isinstance(got, dict):
        return None
    summary = got.get("summary") if got.get("block_tokens") == BLOCK_TOKENS else None
    held = frozenset(h for h in summary[:SUMMARY_LIMIT] if isinstance(h, str)) \
        if isinstance(summary, list) else frozenset[str]()
    counts = {f.name: int(got.get(f.name, 0)) for f in fields(PrefixCache) if f.name != "held"}
    return PrefixCache(held=held, **counts)


def _adapter_requests(status: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """A replica status's `adapter_requests` as name -> (running, waiting)."""
    got = status.get("adapter_requests")
    if not isinstance(got, dict):
        return {}
    return {name: (int(c.get("running", 0)), int(c.get("waiting", 0)))
            for name, c in got.items() if isinstance(name, str) and isinstance(c, dict)}
