from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from statesvc.tools.example import ExampleAssets, make_example
from tests.fleet import fleet  # noqa: F401  (a fixture)
from shared.fleet import StateSvc


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
