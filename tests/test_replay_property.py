"""Property: incremental state == replay from seq 0 == latest snapshot + tail == after restart."""
from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.reducer import logical_digest
from statesvc.example import ExampleAssets
from tests.inproc import CommandError, call, init_pool, open_service

NAMES = ("a", "b", "c", "d")
ADAPTERS = ("attn-qv-r8", "attn-all-r4", "mlp-only-r16", "all-r2")

command = st.one_of(
    st.tuples(st.just("load"), st.sampled_from(NAMES), st.sampled_from(ADAPTERS),
              st.booleans(), st.booleans()),
    st.tuples(st.just("unload"), st.sampled_from(NAMES), st.booleans()),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(commands=st.lists(command, min_size=1, max_size=25),
       snapshot_every=st.integers(min_value=1, max_value=7))
def test_replay_equals_incremental(example: ExampleAssets, commands: list[tuple[object, ...]],
                                   snapshot_every: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp)
        svc = open_service(data, snapshot_every=snapshot_every)
        init_pool(svc, example.model_dir, max_loras=3, max_rank=16)
        for cmd in commands:
            try:
                if cmd[0] == "load":
                    _, name, adapter, replace, pin = cmd
                    call(svc, "load", name=name, path=str(example.adapter_dirs[str(adapter)]),
                         replace=replace, pin=pin)
                else:
                    _, name, force = cmd
                    call(svc, "unload", name=name, force=force)
            except CommandError:
                pass  # refusals are part of the sequence; they must leave no trace
        incremental = svc.state
        assert incremental.seq == svc.store.head()
        from_zero = svc.rebuild(use_snapshot=False)
        from_snapshot = svc.rebuild(use_snapshot=True)
        svc.store.close()
        restarted = open_service(data, snapshot_every=snapshot_every)
        try:
            states = [incremental, from_zero, from_snapshot, restarted.state]
            assert all(s == incremental for s in states)
            assert len({logical_digest(s) for s in states}) == 1
            slots = [a.slot for a in incremental.adapters.values()]
            assert len(slots) == len(set(slots)) and all(0 <= s < 3 for s in slots)
            snap = restarted.store.latest_snapshot()
            if incremental.seq >= snapshot_every:
                assert snap is not None and snap.seq == incremental.seq // snapshot_every * \
                    snapshot_every
                assert snap.digest == logical_digest(restarted.rebuild(until=snap.seq,
                                                                       use_snapshot=False))
        finally:
            restarted.store.close()
