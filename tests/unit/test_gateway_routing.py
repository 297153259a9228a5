"""The gateway's choice of replica (gateway/routing.py, docs/gateway.md "Routing"): where the
adapter is first, then the longest prefix of the prompt a replica holds among those queued at
most `prefix_slack` above the least queued of their tier, then the queue, then the id. Over a
Router that is not started, its view set here (replica views stand in for polled statuses),
and one poll read from stand-ins for statesvc and the replicas' status replies, for what the
view and /metrics take of a replica's `prefix_cache`."""
from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import Metrics
from gateway.routing import FleetView, PrefixCache, ReplicaView, Router
from shared.prefix import BASE_ROOT, block_hashes, content_root

SHA = "5036" * 16
ROOT = content_root(SHA, 4.0)  # adapter a's version
PROMPT = list(range(1000, 1200))  # 12 whole blocks: summary depths 1, 2, 4, 8


def holding(*depths: int, root: str = ROOT, tokens: list[int] = PROMPT) -> PrefixCache:
    """A prefix cache whose summary holds `tokens`' chain under `root` at `depths` (blocks)."""
    chain = block_hashes(root, tokens)
    return PrefixCache(capacity_blocks=64, used_blocks=len(depths), lookups=0, hit_tokens=0,
                       prompt_tokens=0, held=frozenset(chain[d - 1] for d in depths))


def replica(id: str, queued: int, prefix: PrefixCache | None = None, *,
            resident: frozenset[str] = frozenset({"a"}),
            host: frozenset[str] = frozenset()) -> ReplicaView:
    return ReplicaView(id=id, address=f"tcp://{id}:1", applied_seq=5, queued=queued,
                       resident=resident, max_len=4096, host=host, prefix=prefix)


def router(*replicas: ReplicaView, slack: int = 8) -> Router:
    r = Router("tcp://127.0.0.1:1", prefix_slack=slack)  # not started: the view is set here
    r.view = FleetView(ok=True, error="", head_seq=5, adapters={"a": 5}, roots={"a": ROOT},
                       replicas=replicas)
    return r


def order(r: Router, adapter: str | None = "a", tokens: list[int] = PROMPT) -> list[str]:
    return [v.id for v in r.candidates(adapter, 5, tokens=tokens)]


def test_the_deepest_prefix_wins_within_the_slack() -> None:
    """r3 holds 64 tokens (depth 4) at 8 above the least queue, r2 32 tokens; r4 holds all 8
    blocks but is 9 above it, so it counts as holding none and goes by its queue; requests
    this gateway has sent count as queued."""
    r = router(replica("r1", 0), replica("r2", 3, holding(1, 2)), replica("r3", 8, holding(4)),
               replica("r4", 9, holding(1, 2, 4, 8)), replica("r5", 1, holding(1)))
    assert order(r) == ["r3", "r2", "r5", "r1", "r4"]
    r.sent("tcp://r3:1", "a", 1)  # 9 above now: past the slack
    assert order(r) == ["r2", "r5", "r1", "r3", "r4"]
    # no prompt tokens (or fewer than a block): the queue alone
    assert order(r, tokens=[]) == order(r, tokens=PROMPT[:15]) == ["r1", "r5", "r2", "r3", "r4"]


def test_slack_zero_lets_a_prefix_break_ties_of_the_least_queued_only() -> None:
    r = router(replica("r1", 0), replica("r2", 0, holding(1)), replica("r3", 1, holding(8)),
               slack=0)
    assert order(r) == ["r2", "r1", "r3"]


def test_the_tier_dominates_any_prefix_and_the_guard_is_the_tiers_own() -> None:
    """r3 holds the whole prompt and is idle, but a has no slot there; r1 and r2 hold a in a
    slot: r2's prefix wins there though r2 is queued 12, more than the slack above r3's 0 (the
    least of r2's tier is r1's 10)."""
    neither = frozenset[str]()
    r = router(replica("r1", 10), replica("r2", 12, holding(2)),
               replica("r3", 0, holding(1, 2, 4, 8), resident=neither),
               replica("r4", 0, resident=neither, host=frozenset({"a"})))
    assert order(r) == ["r2", "r1", "r4", "r3"]


def test_the_base_model_is_matched_under_its_own_root() -> None:
    """A base-model request matches prefixes held under BASE_ROOT, never the same tokens
    held under an adapter's root, and an adapter's request the other way round."""
    r = router(replica("r1", 1, holding(8)), replica("r2", 2, holding(4, root=BASE_ROOT)),
               replica("r3", 0))
    assert order(r, None) == ["r2", "r3", "r1"]
    assert order(r, "a") == ["r1", "r3", "r2"]


def test_an_unknown_root_is_ordered_by_the_queue() -> None:
    """A version this gateway just loaded has no root until a poll lists it, and neither has
    an adapter missing from the view's roots: no replica counts as holding its prefix."""
    r = router(replica("r1", 1, holding(8)), replica("r2", 0))
    assert order(r) == ["r1", "r2"]
    r.learn("a", 9, 9)
    assert r.view.adapters == {"a": 9} and r.view.roots == {}
    assert order(r) == ["r2", "r1"]


class Statesvc:
    """Stands in for statesvc's control client: `status` and one page of `list`."""

    def __init__(self, replicas: list[str], adapters: list[dict[str, Any]]) -> None:
        self.replicas, self.adapters = replicas, adapters

    def call(self, cmd: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
        if cmd == "status":
            return {"head_seq": 5, "replicas": [
                {"id": r, "address": f"tcp://{r}:1", "state": "ACTIVE", "agrees": True,
                 "applied_seq": 5} for r in self.replicas]}
        return {"head_seq": 5, "pool": {"max_loras": 2}, "adapters": self.adapters,
                "next_after": None}

    def close(self) -> None:
        pass


ABSENT = object()  # a status without `prefix_cache` (an older replica)


class Polled(Router):
    """A Router whose poll reads stand-ins: `prefix_cache` per replica id, as its status."""

    def __init__(self, caches: dict[str, Any]) -> None:
        super().__init__("tcp://127.0.0.1:1")
        self.caches = caches
        self._state_client = Statesvc(list(caches), [  # type: ignore[assignment]
            {"name": "a", "version": 5, "sha256": SHA, "scaling": 4.0},
            {"name": "b", "version": 3, "sha256": "77" * 32, "scaling": 0.5}])

    def _replica_status(self, address: str) -> dict[str, Any] | None:
        rid = address.removeprefix("tcp://").removesuffix(":1")
        status = {"state": "ACTIVE", "applied_seq": 5, "slots": {"0": {"name": "a"}},
                  "inference": {"running": 0, "waiting": 0, "max_len": 4096}}
        if self.caches[rid] is not ABSENT:
            status["prefix_cache"] = self.caches[rid]
        return status


def test_a_polled_prefix_cache_is_routed_on_and_exported() -> None:
    """The roots are the list's sha256 and scaling; a replica's summary is kept when its
    blocks are 16 tokens (strings only), dropped when they are not; a null `prefix_cache`,
    or none at all, is a replica without one; /metrics exports each cache's blocks and
    counts."""
    chain = block_hashes(ROOT, PROMPT)
    stats = {"capacity_blocks": 64, "used_blocks": 9, "lookups": 3, "hit_tokens": 48,
             "prompt_tokens": 600}
    r = Polled({"r1": None, "r2": {"block_tokens": 16, **stats, "summary": [chain[1], 7]},
                "r3": {"block_tokens": 32, **stats, "summary": chain}, "r4": ABSENT})
    r.refresh()
    assert r.view.roots == {"a": ROOT, "b": content_root("77" * 32, 0.5)}
    views = {v.id: v for v in r.view.replicas}
    assert views["r1"].prefix is None and views["r4"].prefix is None
    assert views["r2"].prefix == PrefixCache(held=frozenset({chain[1]}), **stats)
    assert views["r3"].prefix == PrefixCache(held=frozenset(), **stats)
    assert order(r) == ["r2", "r1", "r3", "r4"]
    samples = {(s.name, s.labels["replica"]): s.value
               for fam in text_string_to_metric_families(Metrics(r).render().decode())
               for s in fam.samples if s.name.startswith("loraplane_prefix_cache_")}
    assert samples == {(f"loraplane_prefix_cache_{k}", rid): v for rid in ("r2", "r3")
                       for k, v in (("used_blocks", 9), ("capacity_blocks", 64),
                                    ("lookups_total", 3), ("prompt_tokens_total", 600),
                                    ("hit_tokens_total", 48))}


def test_one_replicas_malformed_status_leaves_out_that_replica_only() -> None:
    """A status the gateway cannot read (a null where a count goes) drops that replica from
    the view; the poll still succeeds and the others are routed to."""
    stats = {"capacity_blocks": 64, "used_blocks": 9, "lookups": 3, "hit_tokens": 48,
             "prompt_tokens": 600}
    r = Polled({"r1": {"block_tokens": 16, **stats, "capacity_blocks": None, "summary": []},
                "r2": {"block_tokens": 16, **stats, "summary": []}})
    r.refresh()
    assert r.view.ok
    assert [v.id for v in r.view.replicas] == ["r2"]
