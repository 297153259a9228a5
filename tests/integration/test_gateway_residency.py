"""Residency that routers can see: each replica's `status` names its host tier and its own
queue per adapter (docs/protocol.md §13b), the gateway's /metrics exports them (the Gateway
API Inference Extension's `vllm:lora_requests_info` and `loraplane_adapter_*`), and its
replica choice prefers a slot over the host tier over neither, before the queue
(docs/gateway.md, Routing). Real statesvc, two replicas and a gateway, all subprocesses:
r1 with one batch row and slowed steps (a test-only fault switch, so a request still runs
while the test looks), r2 parsing each new adapter into its host tier (`--prefetch`). Two
slots each, three adapters loaded one at a time: a and b fill the slots, c fills none.

The tests run in order on one fleet, each starting from where the one before left it."""
from __future__ import annotations

import threading
from typing import Any, Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared.faults import SLOW_STEP_ENV
from shared.protocol import encode_request, unpack
from shared.replica_protocol import generate_args
from statesvc.tools.example import ExampleAssets
from testkit.fleet import Computed, Gateway, wait_for
from tests.helpers import Fleet, dealer

pytestmark = pytest.mark.timeout(400)
ADAPTERS = {"a": "attn-qv-r8", "b": "all-r2", "c": "attn-all-r4"}
N = 200  # new tokens of r1's long request: 20 s at its slowed 100 ms a step; it is cancelled


class Setup:
    def __init__(self, fleet: Fleet, r1: Computed, r2: Computed, gateway: Gateway,
                 registry: dict[str, dict[str, Any]]) -> None:
        self.fleet, self.r1, self.r2, self.gateway = fleet, r1, r2, gateway
        self.registry = registry  # name -> its `list` row (version, sha256, ...)

    def gauges(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """The replica gauges of the gateway's /metrics: (name, sorted labels) -> value."""
        text = httpx.get(self.gateway.url + "/metrics").text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples
                if s.name.startswith(("loraplane_adapter_", "vllm:lora_requests_info",
                                      "loraplane_gateway_replica_queued"))}

    def resident(self) -> set[tuple[str, str, str]]:
        """(replica, adapter, tier) of every `loraplane_adapter_resident` sample (each 1)."""
        out = set()
        for (name, labels), value in self.gauges().items():
            if name == "loraplane_adapter_resident":
                assert value == 1
                d = dict(labels)
                out.add((d["replica"], d["adapter"], d["tier"]))
        return out

    def info(self, replica: str) -> tuple[str, str]:
        """(running_lora_adapters, waiting_lora_adapters) of `replica`'s lora_requests_info."""
        rows = [dict(labels) for (name, labels) in self.gauges()
                if name == "vllm:lora_requests_info" and dict(labels)["replica"] == replica]
        assert len(rows) == 1 and rows[0]["max_lora"] == "2", rows
        return rows[0]["running_lora_adapters"], rows[0]["waiting_lora_adapters"]

    def complete(self, model: str) -> dict[str, Any]:
        res = httpx.post(self.gateway.url + "/v1/completions", timeout=300, json={
            "model": model, "prompt": [5, 6, 7], "max_tokens": 1, "temperature": 0})
        assert res.status_code == 200, res.text
        return dict(res.json())


def slots(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {h["name"]: h for h in status["slots"].values()}


def host(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in status["host_tier"]}


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, example: ExampleAssets) -> Iterator[Setup]:
    tmp = tmp_path_factory.mktemp("gateway-residency")
    fleet = Fleet(tmp, example)
    try:
        fleet.statesvc.start()
        fleet.init(max_loras=2)
        r1 = fleet.replica("r1", env={SLOW_STEP_ENV: "0.1"},
                           args=("--no-warmup", "--max-batch", "1"))
        r2 = fleet.replica("r2", args=("--no-warmup", "--prefetch"))
        wait_for(lambda: fleet.converged(r1, r2), what="replicas ACTIVE")
        for name, adapter in ADAPTERS.items():  # one at a time: a, then b take the free slots
            fleet.load(name, adapter)
            wait_for(lambda: fleet.converged(r1, r2), what=f"replicas at {name}'s load")
        with fleet.client() as c:
            registry = {a["name"]: a for a in c.call("list", {})["adapters"]}
        # a request that waits on r1 behind its long one must not be given up on meanwhile
        gateway = fleet.gateway("--request-timeout", "3600")
        yield Setup(fleet, r1, r2, gateway, registry)
    finally:
        fleet.stop()


def test_status_and_metrics_show_the_slots_and_a_host_tier_filled_ahead(setup: Setup) -> None:
    reg = setup.registry
    # r2's fill worker parses each new adapter into its host tier beside serving
    wait_for(lambda: set(host(setup.r2.status())) == set(ADAPTERS), what="r2's prefetch")
    for r in (setup.r1, setup.r2):
        status = r.status()
        assert set(slots(status)) == {"a", "b"}  # c was loaded with no slot left
        for name, h in slots(status).items():
            assert (h["version"], h["sha256"]) == (reg[name]["version"], reg[name]["sha256"])
        assert status["adapter_requests"] == {}  # nothing runs or waits
    assert setup.r1.status()["host_tier"] == []  # no request, no --prefetch: nothing parsed
    assert {n: (e["version"], e["sha256"]) for n, e in host(setup.r2.status()).items()} == \
        {n: (reg[n]["version"], reg[n]["sha256"]) for n in ADAPTERS}
    want = {("r1", "a", "slot"), ("r1", "b", "slot"), ("r2", "a", "slot"), ("r2", "b", "slot"),
            ("r2", "a", "host"), ("r2", "b", "host"), ("r2", "c", "host")}
    wait_for(lambda: setup.resident() == want, what="the gateway to export the resident sets")
    assert setup.info("r1") == setup.info("r2") == ("", "")
    assert not any(name in ("loraplane_adapter_running", "loraplane_adapter_waiting")
                   for name, _ in setup.gauges())


def test_the_host_tier_wins_over_neither(setup: Setup) -> None:
    """c is in r2's host tier and nowhere on r1: the gateway sends it to r2, though r1 comes
    first by id and both queues are empty; r2 fills its slot from the host tier (a hit, no
    fetch) and r1 is untouched."""
    before1, before2 = setup.r1.status(), setup.r2.status()
    assert "c" not in slots(before1) and "c" not in host(before1) and "c" in host(before2)
    assert setup.complete("c")["usage"]["completion_tokens"] == 1
    after1, after2 = setup.r1.status(), setup.r2.status()
    assert "c" in slots(after2)
    assert after2["residency"]["host_hits"] == before2["residency"]["host_hits"] + 1
    assert after2["residency"]["misses"] == before2["residency"]["misses"] + 1
    assert after2["residency"]["fetching"] == 0 and after2["blob_fetches"] == \
        before2["blob_fetches"]
    assert after1["residency"] == before1["residency"] and after1["host_tier"] == []
    wait_for(lambda: ("r2", "c", "slot") in setup.resident(), what="the gateway to see c")


def test_a_slot_wins_over_the_host_tier_and_the_queue_is_the_replicas_own(
        setup: Setup) -> None:
    """x is in one of r1's slots and only in r2's host tier (r2 gave its slot to c). r1 runs
    a long request on its one row; the gateway still sends x's request to r1, where it waits:
    r1's status counts it as waiting for x, and /metrics shows r1 running y and x waiting,
    in `vllm:lora_requests_info` and the explicit gauges. Cancelling the long request lets
    it run; r2 never sees it."""
    s1, s2 = setup.r1.status(), setup.r2.status()
    x = next(n for n in slots(s1) if n in host(s2) and n not in slots(s2))
    y = next(n for n in slots(s1) if n != x)
    owner = dealer(setup.r1.listen, timeout_ms=300_000)
    answered: list[dict[str, Any]] = []
    sender = threading.Thread(target=lambda: answered.append(setup.complete(x)), daemon=True)
    try:
        owner.send(encode_request("long", "generate", generate_args(
            [5, 6, 7], adapter=y, max_new_tokens=N, stream=True)))
        assert unpack(owner.recv())["token"]["index"] == 0  # it holds r1's one row
        assert setup.r1.status()["adapter_requests"] == {y: {"running": 1, "waiting": 0}}
        wait_for(lambda: setup.info("r1") == (y, "") and setup.gauges()[
            ("loraplane_gateway_replica_queued", (("replica", "r1"),))] == 1,
            what="the gateway to see r1's running request")
        sender.start()
        wait_for(lambda: setup.r1.status()["adapter_requests"] == {
            y: {"running": 1, "waiting": 0}, x: {"running": 0, "waiting": 1}},
            what=f"the request for {x} to wait on r1")
        assert setup.r2.status()["adapter_requests"] == {}
        wait_for(lambda: setup.info("r1") == (y, x), what="lora_requests_info to show it")
        gauges = setup.gauges()
        assert gauges[("loraplane_adapter_running", (("adapter", y), ("replica", "r1")))] == 1
        assert gauges[("loraplane_adapter_waiting", (("adapter", x), ("replica", "r1")))] == 1
        assert gauges[("loraplane_adapter_waiting", (("adapter", y), ("replica", "r1")))] == 0
        assert setup.info("r2") == ("", "")
        owner.send(encode_request("stop", "cancel", {"id": "long"}))
        while (reply := unpack(owner.recv()))["id"] != "stop":
            pass
        assert reply["result"] == {"cancelled": True}
        sender.join(300)
    finally:
        owner.close(0)
    assert len(answered) == 1 and answered[0]["usage"]["completion_tokens"] == 1
    assert setup.r1.status()["adapter_requests"] == {}
    after2 = setup.r2.status()
    assert after2["residency"] == s2["residency"]  # r2 filled nothing, served nothing of x
    wait_for(lambda: setup.info("r1") == ("", ""), what="r1's queue to empty in /metrics")
