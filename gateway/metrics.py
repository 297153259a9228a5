"""GET /metrics (prometheus_client): requests, tokens and latency per model (the base model
or an adapter: only names the gateway resolved, never a caller's arbitrary string), requests
in flight, each replica's queue, and what routers outside need to prefer the replica holding
an adapter: vLLM's `vllm:lora_requests_info` per replica (the gauge Kubernetes' Gateway API
Inference Extension reads for LoRA-affinity routing), from the replica's own running and
waiting requests per adapter, and explicit gauges of each replica's resident set (slots and
host tier) and per-adapter queue, and its prefix cache's blocks and hits, all from its last
status (docs/gateway.md "Metrics")."""
from __future__ import annotations

import time
from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.routing import Router
from shared.prefix import BLOCK_TOKENS

UNRESOLVED = ""  # the model label of a request refused before its model was resolved
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0)


class FleetCollector(Collector):
    """Read at scrape time from the router's last view and its requests in flight."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self) -> Iterator[Metric]:
        view = self.router.view
        queued = GaugeMetricFamily("loraplane_gateway_replica_queued",
                                   "Requests running or waiting on a replica (its last status "
                                   "plus what this gateway sent since)", labels=["replica"])
        # vLLM's form: one sample per replica, value the scrape time, the adapters in labels:
        # those with requests running on the replica and those with requests waiting there
        # (at its last status), comma-separated as vLLM writes them
        info = GaugeMetricFamily("vllm:lora_requests_info", "Running and waiting LoRA "
                                 "adapters per replica (vLLM's metric)",
                                 labels=["replica", "max_lora", "running_lora_adapters",
                                         "waiting_lora_adapters"])
        resident = GaugeMetricFamily("loraplane_adapter_resident", "1 for each adapter a "
                                     "replica holds in a slot (tier=slot) or parsed in its host "
                                     "tier (tier=host), at its last status",
                                     labels=["replica", "adapter", "tier"])
        running = GaugeMetricFamily("loraplane_adapter_running", "Requests running on an "
                                    "adapter on a replica, at its last status",
                                    labels=["replica", "adapter"])
        waiting = GaugeMetricFamily("loraplane_adapter_waiting", "Requests waiting for an "
                                    "adapter on a replica (its queue), at its last status",
                                    labels=["replica", "adapter"])
        # the prefix cache of each replica that has one on (docs/protocol.md §13b): blocks
        # now, and its counts since it started (a restart begins them again, as a counter's)
        blocks = {k: GaugeMetricFamily(f"loraplane_prefix_cache_{k}_blocks", f"KV blocks of "
                                       f"{BLOCK_TOKENS} tokens a replica's prefix cache {verb}",
                                       labels=["replica"])
                  for k, verb in (("used", "holds"), ("capacity", "can hold"))}
        counts = {k: CounterMetricFamily(f"loraplane_prefix_cache_{k}", what, labels=["replica"])
                  for k, what in (("lookups", "Prompts a replica looked up in its prefix cache"),
                                  ("prompt_tokens", "Prompt tokens a replica looked up in its "
                                   "prefix cache"),
                                  ("hit_tokens", "Prompt tokens whose KV a replica's prefix "
                                   "cache held"))}
        max_lora = str((view.pool or {}).get("max_loras", ""))
        # only registered names become label values (a replica's queue may name anything a
        # client sent it directly)
        known = view.adapters
        now = time.time()
        for r in view.replicas:
            inflight = self.router.inflight(r.address)
            queued.add_metric([r.id], r.queued + sum(inflight.values()))
            requests = {a: c for a, c in sorted(r.requests.items()) if a in known}
            info.add_metric([r.id, max_lora, ",".join(a for a, c in requests.items() if c[0]),
                             ",".join(a for a, c in requests.items() if c[1])], now)
            for a, (run, wait) in requests.items():
                running.add_metric([r.id, a], run)
                waiting.add_metric([r.id, a], wait)
            for tier, names in (("slot", r.resident), ("host", r.host)):
                for a in sorted(names & known.keys()):
                    resident.add_metric([r.id, a, tier], 1)
            if r.prefix is not None:
                for k, gauge in blocks.items():
                    gauge.add_metric([r.id], getattr(r.prefix, f"{k}_blocks"))
                for k, counter in counts.items():
                    counter.add_metric([r.id], getattr(r.prefix, k))
        yield from (queued, info, resident, running, waiting, *blocks.values(),
                    *counts.values())


class Metrics:
    def __init__(self, router: Router) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("loraplane_gateway_requests", "Requests answered, by model, "
                                "endpoint and HTTP status", ["model", "endpoint", "status"],
                                registry=r)
        self.prompt_tokens = Counter("loraplane_gateway_prompt_tokens",
                                     "Prompt tokens of answered requests", ["model"], registry=r)
        self.generation_tokens = Counter("loraplane_gateway_generation_tokens",
                                         "Tokens generated for answered requests", ["model"],
                                         registry=r)
        self.latency = Histogram("loraplane_gateway_request_seconds", "Time from a request's "
                                 "body to its answer (the first byte of a stream)", ["model"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.pending = Gauge("loraplane_gateway_pending", "Requests in flight in the gateway",
                             registry=r)
        r.register(FleetCollector(router))

    def render(self) -> bytes:
        return generate_latest(self.registry)
