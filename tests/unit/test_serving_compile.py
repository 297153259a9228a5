"""Serving compiles nothing after warm-up, whatever the prompts, adapters, loads and unloads, and
whatever the choices (n, best_of: the KV fork) and sampling parameters."""
from __future__ import annotations

import threading
from pathlib import Path

import pytest

from computed.serving.engine import Engine
from computed.model.loader import load_model
from computed.model.runner import Runner
from statesvc.tools.example import ExampleAssets
from testkit.jaxcount import buffer_pointers, counting_compiles
from tests.helpers import live_replica


@pytest.mark.slow  # a replica's warm-up, then serving across adapter changes: out of `make test-quick`
@pytest.mark.parametrize("prefix", [False, True], ids=["whole-prompts", "prefix-cache-and-chunks"])
def test_no_compilation_while_serving_across_adapter_changes(tmp_path: Path, example: ExampleAssets,
                                                            prefix: bool) -> None:
    """With the prefix cache and chunked prefill on, the rounds repeat their prompts (hits,
    saves, evictions from an 8-block store) and chunk the longer ones while others decode."""
    with live_replica(tmp_path, example, max_loras=4) as (cmd, replica):
        config, params = load_model(example.model_dir)
        engine = Engine(Runner(config, params, max_batch=4, max_len=64, extend=prefix), replica,
                        prefill_chunk=16 if prefix else 0, prefix_blocks=8 if prefix else 0)
        assert replica.pool is not None
        # warm-up compiles from the pool's shapes, so it never waits for the pool: a replica
        # keeps applying diffs while it warms up (here a writer holds the pool throughout)
        held, release = threading.Event(), threading.Event()

        def writer_holds_the_pool() -> None:
            with replica.pool._lock:  # type: ignore[union-attr]
                held.set()
                release.wait()

        writer = threading.Thread(target=writer_holds_the_pool)
        writer.start()
        held.wait()
        try:
            engine.warmup()
        finally:
            release.set()
            writer.join()
        assert engine.warm
        adapters = sorted(example.adapter_dirs)
        assert replica.pool is not None
        pointers = buffer_pointers(replica.pool)

        served = []
        with counting_compiles() as compiles:
            for round_ in range(6):
                name = f"a{round_}"
                cmd("load", name=name, path=str(example.adapter_dirs[adapters[round_ % 5]]))
                replica.catch_up()
                for i, length in enumerate([1, 5, 16, 17, 33, 60]):  # every bucket
                    adapter = [None, name, *sorted(replica.state.adapters)][i % 3]
                    assert engine.submit(f"{round_}-{i}", {
                        "adapter": adapter, "input_ids": [(7 * i + j) % 256
                                                          for j in range(length)],
                        "max_new_tokens": 64 - length if i == 5 else 3}, None) is None
                # choices forked from one prefill (kv_cache.copy_row), sampled with parameters
                assert engine.submit(f"{round_}-n", {
                    "adapter": name, "input_ids": [3, 1, 4, 1, 5], "max_new_tokens": 3, "n": 2,
                    "best_of": 3, "temperature": 0.8, "top_k": 8, "repetition_penalty": 1.3},
                    None) is None
                while engine.busy:
                    served += engine.step()
                if len(replica.state.adapters) > 2:
                    cmd("unload", name=sorted(replica.state.adapters)[0])
                    replica.catch_up()
        assert compiles == []
        assert buffer_pointers(replica.pool) == pointers
        assert len(served) == 42 and all(d.error is None for d in served)
        assert all(len(d.result.get("choices", ())) == 2 for d in served if d.req_id.endswith("-n"))
        assert {d.result["adapter"]["name"] for d in served if d.result["adapter"]} >= \
            {f"a{r}" for r in range(6)}
        if prefix:
            assert engine.prefills.cache is not None and engine.prefills.cache.hit_tokens > 0
