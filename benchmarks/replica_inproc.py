"""bench_replica's in-process measurements: one slot write against a pool rebuild
(computed.residency.pool), and one load diff through Replica.apply_events, part by part.

What they run, and why: docs/benchmarks.md, "bench_replica.py".
"""
from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np

from benchmarks.harness import median, percentile, spread
from computed.replica import Replica
from computed.residency.blob_cache import slot_weights
from computed.residency.pool import MemoryPool, PoolSpec, SlotWeights
from shared.client import ControlClient, new_event_id
from shared.events import AdapterLoaded, decode_body
from shared.fingerprint import read_model
from shared.projections import MODULES
from statesvc.tools.example import AdapterSpec, ModelShape
from testkit.fleet import StateSvc
from testkit.jaxcount import counting_compiles

SHAPE = ModelShape(vocab_size=256, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=8, head_dim=64)
MAX_LORAS = 64
MAX_RANK = 16
RANK = 16


@dataclass(frozen=True)
class Settings:
    write_iters: int
    rebuild_iters: int
    replica_loads: int
    loads: int
    replica_counts: tuple[int, ...]
    cycles: int


def adapter_specs(n: int) -> tuple[AdapterSpec, ...]:
    return tuple(AdapterSpec(f"r16-{i:03d}", r=RANK, lora_alpha=32, target_modules=MODULES)
                 for i in range(n))


def pool_spec() -> PoolSpec:
    return PoolSpec(num_layers=SHAPE.num_hidden_layers,
                    module_dims={m: SHAPE.module_dims(m) for m in MODULES},
                    slots=MAX_LORAS, max_rank=MAX_RANK, dtype="float32")


def weights_of(path: Path, scaling: float) -> SlotWeights:
    """An adapter file's weights as a replica parses them (computed/residency/blob_cache.py)."""
    event = AdapterLoaded(name=path.parent.name, version=1, sha256="", size=0, rank=RANK,
                          alpha=scaling * RANK, scaling=scaling, use_rslora=False, targets=MODULES,
                          pinned=False)
    return slot_weights(path.read_bytes(), event)


def formula_bytes(spec: PoolSpec) -> int:
    """What the pool should hold from its shapes alone: per layer, slot and module an A of
    [max_rank, in] and a B of [out, max_rank] in the pool's dtype, plus a float32 scaling
    and an int32 rank per slot."""
    item = np.dtype(spec.dtype).itemsize if spec.dtype != "bfloat16" else 2
    per_slot = sum(spec.num_layers * spec.max_rank * (i + o) for i, o in spec.module_dims.values())
    return spec.slots * (per_slot * item + 4 + 4)


def ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def pointers(pool: MemoryPool) -> list[int]:
    return [a.unsafe_buffer_pointer() for a in jax.tree.leaves(pool.arrays)]


# ---- 1a. one slot write against a rebuild, computed.residency.pool in-process ---------------

def measure_pool(settings: Settings, adapter_files: list[Path], scaling: float) -> dict[str, Any]:
    spec = pool_spec()
    weights = [weights_of(p, scaling) for p in adapter_files[:8]]

    def ready(pool: MemoryPool) -> None:
        jax.block_until_ready(pool.arrays)

    pool = MemoryPool(spec)
    pool_bytes = sum(a.nbytes for a in jax.tree.leaves(pool.arrays))
    for s in range(8):  # warm-up: compiles _write and _clear
        pool.write_slot(s, weights[s])
        pool.clear_slot(s + 8)
    ready(pool)
    before = pointers(pool)
    writes, clears, pads = [], [], []
    with counting_compiles() as compiles:
        for i in range(settings.write_iters):
            slot = (i * 7) % MAX_LORAS
            w = weights[i % len(weights)]
            writes.append(timed(lambda: (pool.write_slot(slot, w), ready(pool))))
            clears.append(timed(lambda: (pool.clear_slot((slot + 32) % MAX_LORAS), ready(pool))))
            pads.append(timed(lambda: pool._padded(w)))  # the host half of write_slot
    in_place = pointers(pool) == before
    digests = [timed(pool.digest) for _ in range(3)]

    def rebuild() -> MemoryPool:
        p = MemoryPool(spec)
        for s in range(MAX_LORAS):
            p.write_slot(s, weights[s % len(weights)])
        ready(p)
        return p

    rebuild()  # warm-up (the pool is dropped at once)
    rebuilds, allocs = [], []
    for _ in range(settings.rebuild_iters):
        t0 = time.perf_counter()
        p = rebuild()
        rebuilds.append(time.perf_counter() - t0)
        del p
        t0 = time.perf_counter()
        p = MemoryPool(spec)
        ready(p)
        allocs.append(time.perf_counter() - t0)
        del p
    write_med, rebuild_med = median(writes), median(rebuilds)
    # each rebuild against the median write: the spread of the ratio over the rebuilds
    per_rebuild = [write_med / r for r in rebuilds]
    return {"pool_mb": round(pool_bytes / 1e6, 1),
            "pool_bytes": pool_bytes, "formula_bytes": formula_bytes(spec),
            "bytes_over_formula": pool_bytes / formula_bytes(spec),
            "compiles_during_writes": len(compiles),
            "write_over_rebuild_spread": [round(v, 5) for v in spread(per_rebuild)],
            "slot_mb": round(pool_bytes / MAX_LORAS / 1e6, 3),
            "write_iters": settings.write_iters, "rebuild_iters": settings.rebuild_iters,
            "write_ms_p50": ms(write_med), "write_ms_p99": ms(percentile(writes, 99)),
            "host_pad_ms_p50": ms(median(pads)),
            "clear_ms_p50": ms(median(clears)),
            "rebuild_ms_p50": ms(rebuild_med), "rebuild_ms_min": ms(min(rebuilds)),
            "alloc_only_ms_p50": ms(median(allocs)),
            "write_over_rebuild": round(write_med / rebuild_med, 5),
            "buffers_in_place": in_place,
            "pool_digest_ms_p50": ms(median(digests))}


# ---- 1b. one load diff through Replica.apply_events, in-process -------------------

def measure_replica(settings: Settings, root: Path, model_dir: Path,
                    adapter_files: list[Path]) -> dict[str, Any]:
    svc = StateSvc(root / "data-inproc")
    try:
        svc.start()
        with ControlClient(svc.control, timeout_s=30) as c:
            def cmd(command: str, **args: Any) -> Any:
                return c.call(command, {"event_id": new_event_id(), **args})

            cmd("pool.init", model=str(model_dir), max_loras=MAX_LORAS, max_rank=MAX_RANK,
                targets="all", dtype="float32")
            replica = Replica(read_model(model_dir), c, root / "replica-inproc")
            replica.bootstrap()

            def apply_next() -> tuple[float, list[tuple[int, Any]]]:
                reply = c.call("events", {"since": replica.applied_seq})
                bodies = [(ev["seq"], decode_body(ev["type"], ev["payload"]))
                          for ev in reply["events"]]
                assert len(bodies) == 1, len(bodies)
                t0 = time.perf_counter()
                replica.apply_events(bodies, log_id=reply["log_id"])
                assert replica.pool is not None
                jax.block_until_ready(replica.pool.arrays)
                return time.perf_counter() - t0, bodies

            def load(name: str, path: Path) -> float:
                cmd("load", name=name, path=str(path.parent))
                return apply_next()[0]

            def unload(name: str) -> float:
                cmd("unload", name=name)
                return apply_next()[0]

            load("warm", adapter_files[-1])  # compiles the write
            unload("warm")                   # and the clear
            n = min(settings.replica_loads, len(adapter_files) - 1)
            cold, warm, unloads = [], [], []
            for i in range(n):  # a new adapter: its blob is fetched from statesvc
                cold.append(load(f"c{i}", adapter_files[i]))
                unloads.append(unload(f"c{i}"))
            for i in range(n):  # the same adapters again: blobs come from the local cache
                warm.append(load(f"w{i}", adapter_files[i]))
                unloads.append(unload(f"w{i}"))
            fetches = replica.blobs.fetches

            # where the time of a cold load goes, part by part, on the same adapter
            cmd("load", name="parts", path=str(adapter_files[0].parent))
            page = c.call("events", {"since": replica.applied_seq})["events"]
            body = decode_body(page[0]["type"], page[0]["payload"])
            assert isinstance(body, AdapterLoaded)
            fetch, cache_read, parse, write, save = [], [], [], [], []
            pool = replica.pool
            assert pool is not None
            for _ in range(10):
                fetch.append(timed(lambda: replica.blobs._fetch(replica.blobs.client, body.sha256, "statesvc")))
                data = replica.blobs.get(body.sha256)
                cache_read.append(timed(lambda: replica.blobs.get(body.sha256)))
                parse.append(timed(lambda: slot_weights(data, body)))
                w = slot_weights(data, body)
                write.append(timed(lambda: (pool.write_slot(63, w),
                                            jax.block_until_ready(pool.arrays))))
                save.append(timed(replica._save_local_state))
            pool.clear_slot(63)

            # a replica rebuilt by replay: every slot full, a fresh Replica bootstraps
            for i in range(MAX_LORAS - 1):  # "parts" holds one slot already
                cmd("load", name=f"full{i}", path=str(adapter_files[i % len(adapter_files)].parent))
            replica.catch_up()
            assert len(replica.holders) == MAX_LORAS
            digest = replica.pool_digest()

            def replay(name: str, *, cached_blobs: bool) -> float:
                cache = root / name
                if cached_blobs:
                    shutil.copytree(replica.blobs.root, cache / "blobs")
                fresh = Replica(read_model(model_dir), c, cache)
                t0 = time.perf_counter()
                fresh.bootstrap()
                assert fresh.pool is not None
                jax.block_until_ready(fresh.pool.arrays)
                elapsed = time.perf_counter() - t0
                assert fresh.pool_digest() == digest
                return elapsed

            replay_cold = replay("replay-cold", cached_blobs=False)
            replay_cached = [replay(f"replay-{i}", cached_blobs=True) for i in range(3)]
    finally:
        svc.stop()
    return {"loads": n, "blob_fetches": fetches,
            "apply_load_cold_ms_p50": ms(median(cold)), "apply_load_cold_ms_p99": ms(percentile(cold, 99)),
            "apply_load_cached_ms_p50": ms(median(warm)),
            "apply_load_cached_ms_p99": ms(percentile(warm, 99)),
            "apply_unload_ms_p50": ms(median(unloads)),
            "replay_64_slots_blobs_fetched_ms": ms(replay_cold),
            "replay_64_slots_blobs_cached_ms_p50": ms(median(replay_cached)),
            "apply_cold_over_replay_cold": round(median(cold) / replay_cold, 4),
            "apply_cached_over_replay_cached": round(median(warm) / median(replay_cached), 4),
            "parts_ms_p50": {"blob_fetch_over_zmq": ms(median(fetch)),
                             "cache_read_and_sha256": ms(median(cache_read)),
                             "parse_safetensors": ms(median(parse)),
                             "pool_write": ms(median(write)),
                             "save_local_state": ms(median(save))}}
