"""The database lost while a batch is decided (PostgreSQL restarting, a network cut): every
request of the batch is answered, the ones not recorded with a retryable `storage_error`,
and the service stays up; the retry, same event_id, is recorded once.

The crash test (tests/crash/test_crash_postgres.py) meets this by chance, about one run in
three, when PostgreSQL stops between two statements of a batch; here one store or blob-store
call of a real SQLite-backed service fails as a lost connection does (an OperationalError)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy.exc import OperationalError

from statesvc.persistence.postgres import PostgresEventStore
from statesvc.service import StateService
from statesvc.tools.example import ExampleAssets
from testkit.inproc import call, init_pool, open_service, request


def lost(*_: Any, **__: Any) -> Any:
    raise OperationalError("SELECT 1", {}, Exception("server closed the connection "
                                                     "unexpectedly"))


def test_lost_while_looking_up_event_ids(svc: StateService, example: ExampleAssets,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    path = str(example.adapter_dirs["attn-qv-r8"])
    req = request("load", name="x", path=path)
    with monkeypatch.context() as m:
        m.setattr(svc.store, "by_event_ids", lost)
        answers, committed = svc.handle([(req, "test"), (request("status"), "test")])
    assert [a.error.code if a.error else None for a in answers] == ["storage_error"] * 2
    assert "retry with the same event_id" in str(answers[0].error) and not committed
    assert svc.store.head() == 1
    [again], _ = svc.handle([(req, "test")])  # the retry
    assert again.error is None and again.result["seq"] == 2
    assert call(svc, "status")["head_seq"] == 2


def test_lost_mid_batch_keeps_what_was_committed(svc: StateService, example: ExampleAssets,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """load x, status (commits x first), events (the database is lost here), load y, unload
    x: the answers before the loss stand; the rest are storage_error and not recorded."""
    dirs = example.adapter_dirs
    x, y = (request("load", name=n, path=str(dirs[d]))
            for n, d in (("x", "attn-qv-r8"), ("y", "mlp-only-r16")))
    drop = request("unload", name="x")
    with monkeypatch.context() as m:
        m.setattr(svc.store, "read", lost)
        answers, committed = svc.handle([(x, "test"), (request("status"), "test"),
                                         (request("events", since=0), "test"), (y, "test"),
                                         (drop, "test")])
    assert answers[0].error is None and answers[0].result["seq"] == 2
    assert answers[1].error is None and answers[1].result["head_seq"] == 2
    assert [a.error.code if a.error else None for a in answers[2:]] == ["storage_error"] * 3
    # a read is asked again; a write is resent with its event_id
    assert str(answers[2].error).endswith("; retry") and "event_id" in str(answers[3].error)
    assert "server closed" in str(answers[2].error) and "SELECT" not in str(answers[2].error)
    assert [e.seq for e in committed] == [2] and svc.store.head() == 2
    again, _ = svc.handle([(y, "test"), (drop, "test"), (y, "test"), (x, "test")])  # retries
    assert [a.result["seq"] for a in again] == [3, 4, 3, 2]  # each recorded once
    assert [e.type for e in svc.store.read(0, 10)] == [
        "pool.configured", "adapter.loaded", "adapter.loaded", "adapter.unloaded"]


def test_lost_between_the_turn_and_the_append_on_postgres(tmp_path: Path, pg_url: str,
                                                         example: ExampleAssets,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """PostgreSQL: the connection is cut (pg_terminate_backend, as a restart does) after the
    batch's turn began and before its append: nothing of the batch is written, its writes
    are answered storage_error, another instance writes meanwhile, and the resends, same
    event_ids, are each recorded once."""
    svc, other = (open_service(tmp_path / d, db_url=pg_url) for d in ("a", "b"))
    init_pool(svc, example.model_dir)
    assert isinstance(svc.store, PostgresEventStore)
    store, append = svc.store, svc.store.append
    dirs = example.adapter_dirs
    x, y = (request("load", name=n, path=str(dirs[d]))
            for n, d in (("x", "attn-qv-r8"), ("y", "mlp-only-r16")))

    def cut_then_append(*args: Any, **kwargs: Any) -> Any:
        assert store._db is not None
        with psycopg.connect(store._dsn, autocommit=True) as db:
            db.execute("SELECT pg_terminate_backend(%s)", (store._db.info.backend_pid,))
        return append(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(store, "append", cut_then_append)
        answers, committed = svc.handle([(x, "test"), (y, "test")])
    assert [a.error.code if a.error else None for a in answers] == ["storage_error"] * 2
    assert not committed and other.store.head() == 1 and other.store.blob_hashes() == set()
    assert call(other, "load", name="z", path=str(dirs["attn-qv-r8"]))["seq"] == 2  # turn free
    again, _ = svc.handle([(x, "test"), (y, "test")])  # the resends
    assert [a.result["seq"] for a in again] == [3, 4]
    twice, _ = svc.handle([(y, "test"), (x, "test")])
    assert [a.result["seq"] for a in twice] == [4, 3]
    assert [e.event_id for e in other.store.read(1, 10)][1:] == [x.args["event_id"],
                                                                 y.args["event_id"]]
    for s in (svc, other):
        s.store.close()


def test_heartbeats_need_no_database(svc: StateService, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch of heartbeats takes no turn and reads no log: a fleet's heartbeats cost a
    shared log nothing, and are registered while the database is away."""
    beat = request("heartbeat", id="r1", address="tcp://127.0.0.1:7200", state="ACTIVE",
                   applied_seq=1, logical_digest="0" * 64, pool_digest="0" * 64)
    with monkeypatch.context() as m:
        for method in ("turn", "read", "by_event_ids", "head"):
            m.setattr(svc.store, method, lost)
        [answer], _ = svc.handle([(beat, "local")])
    assert answer.error is None and answer.result == {"head_seq": 1}
    assert [r["id"] for r in call(svc, "status")["replicas"]] == ["r1"]
