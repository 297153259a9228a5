"""Prefix-aware routing end to end: each replica's `status` reports its prefix cache
(docs/protocol.md §13b `prefix_cache`), the gateway's /metrics exports it, and its replica
choice prefers, within a residency tier, the replica holding the prompt's prefix under the
request's own root (the adapter's content, or the base model's), unless that replica is
queued more than `--prefix-slack` above the others (docs/gateway.md, Routing). Real
statesvc, two replicas and a gateway, all subprocesses: both hold adapter a in a slot with
the prefix cache on; r2's steps are slowed (a test-only fault switch, so a long request
still runs while the test looks); the gateway runs with `--prefix-slack 0`, so a prefix
decides only among the least queued.

Which replica holds a prefix is set either by a request through the gateway (where it went
is read off the replicas' `lookups`) or by one sent straight to a replica's listen socket,
so each routing check also runs against the id order (r1 first). Between a request and the
next routing check the test waits for the gateway to export what the replicas' `status`
says (its view is that poll's).

The tests run in order on one fleet, each starting from where the one before left it."""
from __future__ import annotations

from typing import Any, Iterator

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared.client import ControlClient
from shared.faults import SLOW_STEP_ENV
from shared.prefix import BASE_ROOT, BLOCK_TOKENS, block_hashes, content_root
from shared.protocol import encode_request, unpack
from shared.replica_protocol import GENERATE, generate_args
from statesvc.tools.example import ExampleAssets
from testkit.fleet import Computed, Gateway, wait_for
from tests.helpers import Fleet, dealer

pytestmark = pytest.mark.timeout(300)
MAX_BATCH, MAX_LEN = 2, 256
SHARED = 64  # prompt tokens a pair of prompts below shares: 4 whole blocks, each prompt 5
LONG = 128  # the longer prompt of the last test: 8 blocks, the next summary depth after 4
N = 240  # new tokens of r2's long request: 24 s at its slowed 100 ms a step; it is cancelled
COUNTS = ("capacity_blocks", "used_blocks", "lookups", "hit_tokens", "prompt_tokens")


class Setup:
    def __init__(self, fleet: Fleet, r1: Computed, r2: Computed, gateway: Gateway, base: str,
                 root: str, vocab: int) -> None:
        self.fleet, self.r1, self.r2, self.gateway = fleet, r1, r2, gateway
        self.base, self.root = base, root  # the base model's name; adapter a's prefix root
        self.rng, self.vocab = np.random.default_rng(41), vocab
        self.replicas = {"r1": r1, "r2": r2}

    def tokens(self, n: int) -> list[int]:
        return [int(t) for t in self.rng.integers(0, self.vocab, n)]

    def pair(self, own: int = BLOCK_TOKENS) -> tuple[list[int], list[int]]:
        """Two fresh prompts sharing their first SHARED tokens, then `own` tokens of the
        first's own and a block of the second's."""
        shared = self.tokens(SHARED)
        return shared + self.tokens(own), shared + self.tokens(BLOCK_TOKENS)

    def caches(self) -> dict[str, dict[str, Any]]:
        """Each replica's `prefix_cache` now, by id."""
        return {name: r.status()["prefix_cache"] for name, r in self.replicas.items()}

    def exported(self) -> dict[tuple[str, str], float]:
        """The gateway's per-replica prefix-cache and queue series: (name, replica) -> value."""
        text = httpx.get(self.gateway.url + "/metrics").text
        return {(s.name, s.labels["replica"]): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples
                if s.name.startswith(("loraplane_prefix_cache_", "loraplane_gateway_replica_queued"))}

    def synced(self, **queued: int) -> None:
        """Wait until the gateway exports every replica's prefix cache as its `status` has it
        now, and each replica queued as given (0 where not named)."""
        def same() -> bool:
            got, caches = self.exported(), self.caches()
            want = {(f"loraplane_prefix_cache_{k}" if k.endswith("_blocks") else
                     f"loraplane_prefix_cache_{k}_total", r): float(cache[k])
                    for r, cache in caches.items() for k in COUNTS}
            want.update({("loraplane_gateway_replica_queued", r): float(queued.get(r, 0))
                         for r in self.replicas})
            return got == want
        wait_for(same, what="the gateway to export the replicas' prefix caches")

    def complete(self, model: str, prompt: list[int]) -> dict[str, Any]:
        res = httpx.post(self.gateway.url + "/v1/completions", timeout=300, json={
            "model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0})
        assert res.status_code == 200, res.text
        return dict(res.json())

    def generate(self, replica: Computed, adapter: str | None, prompt: list[int]) -> None:
        """One request straight to `replica`'s listen socket, past the gateway."""
        with ControlClient(replica.listen, timeout_s=300, retries=0) as c:
            assert len(c.call(GENERATE, generate_args(prompt, adapter=adapter,
                                                      max_new_tokens=1))["output_ids"]) == 1

    def served(self, model: str, prompt: list[int]) -> tuple[str, int]:
        """Send a completion through the gateway: (the replica that served it, the prompt
        tokens its prefix cache held). Nothing else changes on any replica."""
        before = self.caches()
        assert self.complete(model, prompt)["usage"]["prompt_tokens"] == len(prompt)
        after = self.caches()
        moved = {r for r in after if after[r]["lookups"] != before[r]["lookups"]}
        assert len(moved) == 1, (before, after)
        (r,) = moved
        assert after[r]["lookups"] == before[r]["lookups"] + 1
        assert after[r]["prompt_tokens"] == before[r]["prompt_tokens"] + len(prompt)
        assert all(after[o] == before[o] for o in after if o != r)
        return r, after[r]["hit_tokens"] - before[r]["hit_tokens"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, example: ExampleAssets) -> Iterator[Setup]:
    tmp = tmp_path_factory.mktemp("gateway-prefix")
    fleet = Fleet(tmp, example)
    size = ("--no-warmup", "--max-batch", str(MAX_BATCH), "--max-len", str(MAX_LEN))
    try:
        fleet.statesvc.start()
        fleet.init(max_loras=2)
        r1 = fleet.replica("r1", args=size)
        r2 = fleet.replica("r2", env={SLOW_STEP_ENV: "0.1"}, args=size)
        wait_for(lambda: fleet.converged(r1, r2), what="replicas ACTIVE")
        fleet.load("a", sorted(example.adapter_dirs)[0])  # a free slot takes it on both
        wait_for(lambda: fleet.converged(r1, r2), what="replicas at a's load")
        with fleet.client() as c:
            row = next(a for a in c.call("list", {})["adapters"] if a["name"] == "a")
        gateway = fleet.gateway("--prefix-slack", "0")
        yield Setup(fleet, r1, r2, gateway, example.model_dir.name,
                    content_root(row["sha256"], row["scaling"]), example.shape.vocab_size)
    finally:
        fleet.stop()


def test_status_reports_an_empty_cache_and_the_gateway_exports_it(setup: Setup) -> None:
    """The default --kv-cache-mb gives the store as many bytes as the rows' cache (here far
    below the default's 1 GiB cap): as many 16-token blocks as the rows hold positions."""
    for r in (setup.r1, setup.r2):
        status = r.status()
        assert {h["name"] for h in status["slots"].values()} == {"a"}
        assert status["prefix_cache"] == {
            "block_tokens": BLOCK_TOKENS, "capacity_blocks": MAX_BATCH * MAX_LEN // BLOCK_TOKENS,
            "used_blocks": 0, "lookups": 0, "hit_tokens": 0, "prompt_tokens": 0, "summary": []}
    setup.synced()


def test_a_prompt_goes_to_the_replica_holding_its_prefix(setup: Setup) -> None:
    """A first prompt on a goes wherever the gateway sends it (nothing holds it yet); a second
    sharing its first 64 tokens follows it there and reuses them. A prefix seeded on the other
    replica, straight on its socket, draws the next pair there: one of the two routes goes
    against the id order."""
    first, second = setup.pair()
    holder, hit = setup.served("a", first)
    assert hit == 0
    cache = setup.replicas[holder].status()["prefix_cache"]
    assert cache["used_blocks"] == len(first) // BLOCK_TOKENS  # every whole block saved
    chain = block_hashes(setup.root, first)
    assert chain[0] in cache["summary"] and chain[3] in cache["summary"]  # depths 1 and 4
    assert chain[2] not in cache["summary"]  # depth 3: not reported
    setup.synced()
    assert setup.served("a", second) == (holder, SHARED)

    other = "r2" if holder == "r1" else "r1"
    first, second = setup.pair()
    setup.generate(setup.replicas[other], "a", first)
    setup.synced()
    assert setup.served("a", second) == (other, SHARED)


def test_the_base_model_keeps_prefixes_of_its_own(setup: Setup) -> None:
    """r2 holds a prompt under a; the same tokens on the base model have another root: the
    gateway does not count r2's blocks for them (the id order sends them to r1, which hits
    nothing), and r2 itself, asked straight, hits nothing either. A base prompt seeded on r2
    then draws the base request that shares its prefix."""
    first, _ = setup.pair()
    setup.generate(setup.r2, "a", first)
    setup.synced()
    assert setup.served(setup.base, first) == ("r1", 0)
    before = setup.r2.status()["prefix_cache"]
    setup.generate(setup.r2, None, first)
    after = setup.r2.status()["prefix_cache"]
    assert after["lookups"] == before["lookups"] + 1 and after["hit_tokens"] == before["hit_tokens"]
    assert block_hashes(BASE_ROOT, first)[0] in after["summary"]

    first, second = setup.pair()
    setup.generate(setup.r2, None, first)
    setup.synced()
    assert setup.served(setup.base, second) == ("r2", SHARED)


def test_past_the_slack_the_queue_decides(setup: Setup) -> None:
    """r2 holds a 128-token prompt and runs a long request: one queued, r1 none, so with
    --prefix-slack 0 its prefix does not count and the next prompt sharing 64 tokens of it
    goes to the idle r1. Once the long request is cancelled and both are idle again, a prompt
    sharing all 128 goes to r2, the deeper holder (r1 holds 64 of them now)."""
    first, second = setup.pair(own=LONG - SHARED)
    setup.generate(setup.r2, "a", first)
    owner = dealer(setup.r2.listen, timeout_ms=300_000)
    try:
        owner.send(encode_request("long", "generate", generate_args(
            [5, 6, 7], adapter="a", max_new_tokens=N, stream=True)))
        assert unpack(owner.recv())["token"]["index"] == 0  # it runs on r2
        setup.synced(r2=1)
        assert setup.served("a", second) == ("r1", 0)
        owner.send(encode_request("stop", "cancel", {"id": "long"}))
        while (reply := unpack(owner.recv()))["id"] != "stop":
            pass
        assert reply["result"] == {"cancelled": True}
    finally:
        owner.close(0)
    setup.synced()
    assert setup.served("a", first + setup.tokens(BLOCK_TOKENS)) == ("r2", LONG)
