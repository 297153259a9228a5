"""A replica applying 200 load and unload diffs after warm-up: no compilation, same buffers."""
from __future__ import annotations

from pathlib import Path

from statesvc.tools.example import ExampleAssets
from testkit.jaxcount import buffer_pointers, counting_compiles
from tests.helpers import live_replica


def test_200_diffs_compile_nothing_and_keep_the_buffers(tmp_path: Path,
                                                        example: ExampleAssets) -> None:
    with live_replica(tmp_path, example, max_loras=8) as (cmd, replica):
        adapters = sorted(example.adapter_dirs)
        assert replica.pool is not None
        pointers = buffer_pointers(replica.pool)
        digests = set()
        kinds = []
        with counting_compiles() as compiles:
            for i in range(200):  # loads and unloads over every slot and rank
                loaded = sorted(replica.state.adapters)
                if len(loaded) < 3 or (i % 3 and len(loaded) < 7):
                    name = next(f"a{j}" for j in range(i, i + 8) if f"a{j}" not in loaded)
                    cmd("load", name=name, path=str(example.adapter_dirs[adapters[i % 5]]))
                    kinds.append("load")
                else:
                    cmd("unload", name=loaded[(i * 7) % len(loaded)])
                    kinds.append("unload")
                assert replica.catch_up() == 1
                digests.add(replica.pool_digest())
        assert compiles == []
        assert buffer_pointers(replica.pool) == pointers
        assert replica.applied_seq == 1 + 2 + 200
        assert len(digests) > 100  # the pool really changed
        assert kinds.count("load") > 50 and kinds.count("unload") > 50
