from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from shared.fleet import StateSvc
from statesvc.tools.example import ExampleAssets, make_example
from tests.helpers import Fleet


@pytest.fixture(scope="session")
def example(tmp_path_factory: pytest.TempPathFactory) -> ExampleAssets:
    """The example checkpoint and adapters, written once per test session."""
    return make_example(tmp_path_factory.mktemp("example"), seed=0)


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
