"""Property: incremental state == replay from seq 0 == latest snapshot + tail == after restart,
on SQLite and on PostgreSQL (a new database per example, blobs in it)."""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Callable

import pytest

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.reducer import logical_digest
from statesvc.tools.example import ExampleAssets
from testkit.inproc import CommandError, call, init_pool, open_service, request
from testkit.pg import PgServer

NAMES = ("a", "b", "c", "d")


@pytest.fixture(params=["sqlite", "postgresql"])
def new_db(request: pytest.FixtureRequest) -> Callable[[], str | None]:
    """Makes the database of one example: None (SQLite in the example's data dir), or an
    empty PostgreSQL database on the session's server (one, emptied for each example)."""
    if request.param == "sqlite":
        return lambda: None
    server: PgServer = request.getfixturevalue("pg_server")
    url = server.database()
    return lambda: server.reset(url)
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
def test_replay_equals_incremental(example: ExampleAssets, new_db: Callable[[], str | None],
                                   commands: list[tuple[object, ...]],
                                   snapshot_every: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        data, db_url = Path(tmp), new_db()
        svc = open_service(data, snapshot_every=snapshot_every, db_url=db_url)
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
        restarted = open_service(data, snapshot_every=snapshot_every, db_url=db_url)
        try:
            states = [incremental, from_zero, from_snapshot, restarted.state]
            assert all(s == incremental for s in states)
            assert len({logical_digest(s) for s in states}) == 1
            snap = restarted.store.latest_snapshot()
            if incremental.seq >= snapshot_every:
                assert snap is not None and snap.seq == incremental.seq // snapshot_every * \
                    snapshot_every
                assert snap.digest == logical_digest(restarted.rebuild(until=snap.seq,
                                                                       use_snapshot=False))
        finally:
            restarted.store.close()


def test_requests_that_arrive_meanwhile_join_the_commit(example: ExampleAssets,
                                                       tmp_path: Path) -> None:
    """`handle(..., more=...)`: requests handed over before the commit are validated after
    the batch's, committed with it, and answered in order; a retry among them is idempotent."""
    svc = open_service(tmp_path)
    try:
        init_pool(svc, example.model_dir, max_loras=3, max_rank=16)
        load_a = request("load", name="a", path=str(example.adapter_dirs["attn-qv-r8"]))
        late = [[request("load", name="b", path=str(example.adapter_dirs["all-r2"])), load_a],
                [request("list"), request("unload", name="a")], []]
        answers, committed = svc.handle([(load_a, "t")],
                                        more=lambda: [(r, "t") for r in late.pop(0)])
        assert [a.error for a in answers] == [None] * 5
        assert [a.result["seq"] for a in answers[:3]] == [2, 3, 2]  # the retry: the original
        assert answers[3].result["head_seq"] == 3  # a read commits the writes before it
        assert answers[4].result == {"seq": 4, "name": "a", "version": 2}
        assert [e.seq for e in committed] == [2, 3, 4] and svc.store.head() == 4
        assert len({e.recorded_at for e in committed}) == 2  # seqs 2-3, then 4
        assert late == []
    finally:
        svc.store.close()
