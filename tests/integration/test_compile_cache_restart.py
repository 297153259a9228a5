"""A replica's persistent compilation cache (computed/model/compile_cache.py), with real processes:
the first start compiles its warm-up and reports `warming` until it is done; a restart with the
same --cache-dir compiles nothing (counted, not timed) and serves the same tokens; another flag
set gets a directory of its own."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from statesvc.tools.example import ExampleAssets
from tests.helpers import WARMUP_TIMEOUT_S, Fleet, xla_flags
from testkit.fleet import Computed, wait_for

# the replica keys its own cache: the session's (JAX_COMPILATION_CACHE_DIR, tests/conftest.py)
# would win over --cache-dir
OWN_CACHE = {"JAX_COMPILATION_CACHE_DIR": ""}
SIZE = ("--max-batch", "2", "--max-len", "32", "--no-prefix-cache", "--prefill-chunk", "0")
PROMPT = [5, 17, 33, 2, 81, 9]


def _ready(replica: Computed) -> dict[str, Any]:
    states: list[str] = []

    def ready() -> bool:  # and done compiling what it compiles after it is ready
        inference = replica.status()["inference"]
        states.append(inference["state"])
        return states[-1] == "ready" and not inference["warmup"]["pending"]
    wait_for(ready, what="warm-up", timeout=WARMUP_TIMEOUT_S)
    assert set(states) <= {"warming", "ready"}, states
    inference: dict[str, Any] = replica.status()["inference"]
    return inference


def _tokens(replica: Computed, adapter: str | None) -> list[int]:
    res = replica.call("generate", adapter=adapter, input_ids=PROMPT, max_new_tokens=5)
    return list(res["output_ids"])


def test_restart_with_the_same_cache_dir_compiles_nothing(tmp_path: Path, example: ExampleAssets) -> None:
    fleet = Fleet(tmp_path, example)
    fleet.statesvc.start()
    try:
        fleet.init(max_loras=2, max_rank=8)
        fleet.load("qv", "attn-qv-r8")
        replica = fleet.replica("r1", args=SIZE, env=OWN_CACHE)
        first = _ready(replica)
        assert first["warmup"]["compiles"] > 0 and first["warmup"]["cache_hits"] == 0, first["warmup"]
        keyed = [p for p in (tmp_path / "replicas" / "r1" / "xla").iterdir() if p.is_dir()]
        assert len(keyed) == 1 and any(keyed[0].iterdir()), keyed
        before = {a: _tokens(replica, a) for a in (None, "qv")}
        memory = first["memory"]
        assert memory["weights"] > 0 and memory["kv_rows"] > 0 and memory["rss"] >= memory["weights"], memory

        replica.stop()
        replica.start()
        again = _ready(replica)
        # every compile of the warm-up came from the cache: XLA compiled nothing
        assert again["warmup"]["compiles"] == 0, again["warmup"]
        assert again["warmup"]["cache_hits"] == first["warmup"]["compiles"], again["warmup"]
        assert {a: _tokens(replica, a) for a in (None, "qv")} == before

        # another flag set (XLA_FLAGS) never reads those entries: a directory of its own
        replica.stop()
        replica.env = {**OWN_CACHE, "XLA_FLAGS": xla_flags("--xla_cpu_enable_fast_min_max=false")}
        replica.start()
        other = _ready(replica)
        assert other["warmup"]["cache_hits"] == 0 and other["warmup"]["compiles"] > 0, other["warmup"]
        assert len([p for p in (tmp_path / "replicas" / "r1" / "xla").iterdir() if p.is_dir()]) == 2
    finally:
        fleet.stop()
