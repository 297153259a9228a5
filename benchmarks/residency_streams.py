"""The request streams of the residency benchmark (benchmarks/bench_residency.py).

What it runs, and why: docs/benchmarks.md, "residency_streams.py".
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks.harness import percentile
from computed.serving.engine import Engine
from computed.serving.rows import Done
from computed.replica import Replica
from shared.replica_protocol import generate_args

PROMPT, NEW_TOKENS, BATCH = 16, 8, 32
CALIBRATE = 24  # adapters filled on an idle replica for each tier's floor (12 gave medians
# 0.70-1.33 ms for the same code: the figure it divides moved by half)
TIERS = ("host", "miss")


def zipf_stream(n_names: int, n: int, s: float, rng: np.random.Generator) -> list[int]:
    """`n` ranks (0 = most popular) drawn with p(rank i) proportional to 1 / (i + 1)^s."""
    p = 1.0 / np.arange(1, n_names + 1) ** s
    return [int(r) for r in rng.choice(n_names, size=n, p=p / p.sum())]


def tier_of(replica: Replica, name: str) -> str:
    a = replica.state.adapters[name]
    assert replica.residency is not None
    if replica.residency.slot_of(a.name, a.version) is not None:
        return "resident"
    return "host" if (a.name, a.version) in replica.fills.host else "miss"


class Stream:
    """One run's requests as they are sent and answered: tier at sending, TTFT."""

    def __init__(self, engine: Engine, replica: Replica, adapters: list[str],
                 prompts: np.ndarray) -> None:
        self.engine, self.replica, self.adapters, self.prompts = engine, replica, adapters, prompts
        self.sent = self.inflight = 0
        self.tier: dict[str, str] = {}
        self.late: dict[str, float] = {}  # seconds from the scheduled arrival to the submit
        self.ttft_ms: dict[str, float] = {}
        self.wait_ms: dict[str, float] = {}  # the engine's residency_ms: waiting for a slot

    def send(self, late_s: float = 0.0) -> None:
        rid, name = str(self.sent), self.adapters[self.sent]
        self.tier[rid], self.late[rid] = tier_of(self.replica, name), late_s
        args = generate_args(self.prompts[self.sent % len(self.prompts)].tolist(), adapter=name,
                             max_new_tokens=NEW_TOKENS)
        immediate = self.engine.submit(rid, args, rid)
        assert immediate is None, immediate
        self.sent, self.inflight = self.sent + 1, self.inflight + 1

    def step(self, intake: Callable[[], object] | None = None) -> None:
        if not any(r is not None for r in self.engine.rows):
            time.sleep(0.001)  # only waiters: the fill worker runs (as the daemon's poll)
        out: list[Done] = self.engine.step(intake)
        for d in out:
            assert d.result is not None, d.error
            self.inflight -= 1
            t = d.result["timings"]
            self.ttft_ms[d.req_id] = self.late[d.req_id] * 1e3 + t["queue_ms"] + t["prefill_ms"]
            self.wait_ms[d.req_id] = t["residency_ms"]

    @property
    def busy(self) -> bool:
        return self.sent < len(self.adapters) or self.inflight > 0


def drive(engine: Engine, replica: Replica, adapters: list[str], prompts: np.ndarray
          ) -> dict[str, Any]:
    """Closed loop: one request per entry of `adapters`, at most BATCH in flight."""
    s = Stream(engine, replica, adapters, prompts)
    t0 = time.perf_counter()
    while s.busy:
        while s.sent < len(adapters) and s.inflight < BATCH:
            s.send()
        s.step()
    seconds = time.perf_counter() - t0
    return {"tokens_per_s": len(adapters) * NEW_TOKENS / seconds, "seconds": seconds,
            "tier": s.tier, "ttft_ms": s.ttft_ms, "wait_ms": s.wait_ms}


def drive_open(engine: Engine, replica: Replica, adapters: list[str], prompts: np.ndarray,
               rate: float) -> dict[str, Any]:
    """Open loop: request i is due at i / `rate` s from the start, however many are in flight;
    those that came due are sent before each step and after each prefill (the engine's
    intake, as the daemon reads its socket), and TTFT counts from when each was due."""
    s = Stream(engine, replica, adapters, prompts)
    t0 = time.perf_counter()

    def intake() -> None:
        now = time.perf_counter()
        while s.sent < len(adapters) and (due := t0 + s.sent / rate) <= now:
            s.send(now - due)

    while s.busy:
        intake()
        if not engine.busy and s.sent < len(adapters):
            time.sleep(max(0.0, t0 + s.sent / rate - time.perf_counter()))
            continue
        s.step(intake)
    return {"seconds": time.perf_counter() - t0, "tier": s.tier, "ttft_ms": s.ttft_ms,
            "wait_ms": s.wait_ms}


def cold_tiers(replica: Replica) -> None:
    """Empty the host tier and the on-disk blob cache: the next fill of anything not in a slot
    reads its blob from statesvc (a blob that is gone is fetched again, computed/residency/blob_cache.py)."""
    replica.fills.retain(lambda name, version: False)
    for p in replica.blobs.root.iterdir():
        p.unlink(missing_ok=True)


def calibrate(engine: Engine, replica: Replica, names: list[str], prompts: np.ndarray
              ) -> dict[str, float]:
    """Each tier's floor on an idle replica: fills of `names` one request at a time, first from
    statesvc (a miss), then, after other adapters took their slots, from the host tier."""
    for t in replica.fills.times.values():
        t.clear()
    for name in names:
        drive(engine, replica, [name], prompts)
    assert replica.pool is not None
    drive(engine, replica, [a for a in replica.state.adapters if a not in names]
          [:replica.pool.spec.slots], prompts)  # evict them from the slots
    for name in names:
        drive(engine, replica, [name], prompts)
    floors = {t: float(np.median(list(v))) * 1e3 if v else 0.0
              for t, v in replica.fills.times.items()}
    for t in replica.fills.times.values():
        t.clear()
    return floors


def counters(replica: Replica) -> dict[str, int]:
    res = replica.residency
    assert res is not None
    f = replica.fills
    return {"hits": res.hits, "misses": res.misses, "evictions": res.evictions,
            "host_hits": f.hits, "host_misses": f.misses, "host_evictions": f.host.evictions}


def pct(xs: list[float]) -> dict[str, Any]:
    out: dict[str, Any] = {"n": len(xs)}
    if xs:
        out.update({q: percentile(xs, p) for q, p in (("p50", 50), ("p99", 99))})
    return out


def shift(zipf: list[float], resident: list[float]) -> dict[str, Any]:
    """p50 and p99 of `zipf` minus those of `resident` (ms)."""
    a, b = pct(zipf), pct(resident)
    return {"n": a["n"], **({q: a[q] - b[q] for q in ("p50", "p99")} if "p50" in a else {})}


def over(cell: dict[str, Any], floor: float) -> dict[str, Any]:
    """`cell` with its p50 and p99 over `floor` (ms)."""
    if "p50" in cell and floor:
        cell.update({f"{q}_over_floor": cell[q] / floor for q in ("p50", "p99")})
    return cell


def run_streams(engine: Engine, replica: Replica, order: list[str], rounds: int,
                requests: int, zipf: float, load: float, prompts: np.ndarray,
                rng: np.random.Generator) -> dict[str, Any]:
    """The `rounds` alternated pairs (module docstring) over `order` (rank -> name), after the
    floors are calibrated; returns the figures of one slot count."""
    assert replica.pool is not None
    slots = replica.pool.spec.slots
    floors = calibrate(engine, replica, order[-CALIBRATE - 1:-1], prompts)
    hot = order[:slots]
    ratios: list[float] = []
    res_tps: list[float] = []
    zipf_tps: list[float] = []
    fill_s: dict[str, list[float]] = {t: [] for t in TIERS}
    closed: dict[str, list[float]] = {"resident": [], "host": [], "miss": []}
    added: dict[str, list[float]] = {"resident": [], "host": [], "miss": []}
    opened: dict[str, list[float]] = {"resident": [], "host": [], "miss": []}
    before: dict[str, list[float]] = {"resident": [], "host": [], "miss": []}  # fetch_wait 0
    paired: dict[str, list[float]] = {"resident": [], "host": [], "miss": []}  # their R TTFT
    waited: dict[str, list[float]] = {"resident": [], "host": [], "miss": []}  # in the run
    fetch_wait = engine.fetch_wait
    moved = {k: 0 for k in counters(replica)}
    distinct: list[int] = []
    rates: list[float] = []

    def run(kind: str, adapters: list[str], rate: float | None) -> dict[str, Any]:
        drive(engine, replica, hot, prompts)  # the same start: the hot set in the slots
        engine.fetch_wait = 0.0 if kind == "zipf-no-wait" else fetch_wait
        if kind == "resident":
            return drive(engine, replica, adapters, prompts) if rate is None else \
                drive_open(engine, replica, adapters, prompts, rate)
        cold_tiers(replica)  # every Zipf run starts from the same tiers
        for samples in replica.fills.times.values():
            samples.clear()
        start = counters(replica)
        out = drive(engine, replica, adapters, prompts) if rate is None else \
            drive_open(engine, replica, adapters, prompts, rate)
        if kind == "zipf-no-wait":
            return out  # the "before" run: its fills are not counted twice
        for k, v in counters(replica).items():
            moved[k] += v - start[k]
        for tier in TIERS:
            fill_s[tier] += list(replica.fills.times[tier])
        return out

    for k in range(rounds):
        ranks = zipf_stream(len(order), requests, zipf, rng)
        distinct.append(len(set(ranks)))
        streams = {"resident": [order[r % slots] for r in ranks], "zipf": [order[r] for r in ranks]}
        pair = ("resident", "zipf") if k % 2 == 0 else ("zipf", "resident")
        c = {kind: run(kind, streams[kind], None) for kind in pair}
        res_tps.append(c["resident"]["tokens_per_s"])
        zipf_tps.append(c["zipf"]["tokens_per_s"])
        ratios.append(zipf_tps[-1] / res_tps[-1])
        for rid, t in c["zipf"]["tier"].items():
            closed[t].append(c["zipf"]["ttft_ms"][rid])
        rates.append(load * res_tps[-1] / NEW_TOKENS)
        streams["zipf-no-wait"] = streams["zipf"]
        trio = ("resident", "zipf", "zipf-no-wait")
        o = {kind: run(kind, streams[kind], rates[-1]) for kind in
             (trio if k % 2 == 0 else trio[::-1])}
        for rid, t in o["zipf"]["tier"].items():
            opened[t].append(o["zipf"]["ttft_ms"][rid])
            paired[t].append(o["resident"]["ttft_ms"][rid])
            added[t].append(o["zipf"]["ttft_ms"][rid] - o["resident"]["ttft_ms"][rid])
            waited[t].append(o["zipf"]["wait_ms"][rid])
        for rid, t in o["zipf-no-wait"]["tier"].items():
            before[t].append(o["zipf-no-wait"]["ttft_ms"][rid] - o["resident"]["ttft_ms"][rid])
    n = rounds * requests
    hits, misses = moved["host_hits"], moved["host_misses"]
    out: dict[str, Any] = {
        "slots": slots, "floors_ms": floors, "rounds": rounds,
        "resident_tokens_per_s": float(np.median(res_tps)),
        "zipf_tokens_per_s": float(np.median(zipf_tps)),
        "throughput_ratio": float(np.median(ratios)), "throughput_ratio_runs": ratios,
        "distinct_adapters": distinct,
        "fill_ms": {t: pct([x * 1e3 for x in fill_s[t]]) for t in TIERS},
        "host_hit_rate": hits / max(1, hits + misses),
        "slot_misses": moved["misses"], "host_evictions": moved["host_evictions"],
        "evictions_per_1000": 1000 * moved["evictions"] / (2 * n),  # closed and open runs
        "ttft_resident": pct(closed["resident"]),
        "open": {"load": load, "rate_rps": rates,
                 "ttft": {t: over(pct(opened[t]), floors.get(t, 0.0)) for t in TIERS},
                 "ttft_resident": pct(opened["resident"]),
                 "added_resident": pct(added["resident"]),
                 "added": {t: over(pct(added[t]), floors.get(t, 0.0)) for t in TIERS},
                 # within the Zipf run: each request's wait for its slot from when it first
                 # had a row (the engine's residency_ms), its slot write included
                 "waited": {t: over(pct(waited[t]), floors.get(t, 0.0))
                            for t in (*TIERS, "resident")},
                 # p50 and p99 of the Zipf run's TTFTs - of the same requests' in the
                 # all-resident run: the shift of the distribution, less noisy at the tail than
                 # the p99 of per-request differences (where runs drift apart by whole steps)
                 "shift": {t: over(shift(opened[t], paired[t]), floors.get(t, 0.0))
                           for t in (*TIERS, "resident")},
                 "fetch_wait": fetch_wait,
                 "added_no_wait": {t: over(pct(before[t]), floors.get(t, 0.0)) for t in TIERS}}}
    for t in TIERS:
        out[f"ttft_{t}"] = over(pct(closed[t]), floors[t])
    return out
