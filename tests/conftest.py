from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from shared.fleet import StateSvc
from statesvc.service import StateService
from statesvc.tools.example import ExampleAssets, make_example
from statesvc.tools.inproc import init_pool, open_service
from tests.helpers import Fleet
from tests.pg import PgServer


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules that hold `slow` tests run first, each module's own order kept: under
    `make test`'s two workers (pytest-xdist, one module per worker at a time, in this order
    with --no-loadscope-reorder) the longest modules start at once instead of leaving one
    worker alone with them at the end."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)


@pytest.fixture(scope="session")
def example(tmp_path_factory: pytest.TempPathFactory) -> ExampleAssets:
    """The example checkpoint and adapters, written once per test session."""
    return make_example(tmp_path_factory.mktemp("example"), seed=0)


@pytest.fixture
def svc(tmp_path: Path, example: ExampleAssets) -> Iterator[StateService]:
    """The state service in-process over SQLite in tmp_path, the example's pool configured."""
    service = open_service(tmp_path / "data")
    init_pool(service, example.model_dir)
    yield service
    service.store.close()


@pytest.fixture
def statesvc(tmp_path: Path) -> Iterator[StateSvc]:
    svc = StateSvc(tmp_path / "data")
    try:
        yield svc.start()
    finally:
        svc.stop()


@pytest.fixture
def fleet(tmp_path: Path, example: ExampleAssets) -> Iterator[Fleet]:
    f = Fleet(tmp_path, example)
    f.statesvc.start()
    try:
        yield f
    finally:
        f.stop()


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    """One real PostgreSQL server for the session (tests/pg.py), stopped by pid at the end;
    tests are skipped, saying why, only where the server binaries are missing."""
    why = PgServer.missing()
    if why is not None:
        pytest.skip(why)
    server = PgServer()
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture
def pg_url(pg_server: PgServer) -> str:
    """The URL of a new, empty database on the session's PostgreSQL server."""
    return pg_server.database()


@pytest.fixture
def two(tmp_path: Path, pg_url: str) -> Iterator[tuple[StateSvc, StateSvc]]:
    """Two statesvc instances on one new PostgreSQL database (docs/postgres.md)."""
    a = StateSvc(tmp_path / "a", extra_args=("--db", pg_url))
    b = StateSvc(tmp_path / "b", extra_args=("--db", pg_url))
    try:
        yield a.start(), b.start()
    finally:
        a.stop()
        b.stop()
