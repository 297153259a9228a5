"""A statesvc and its replicas as real subprocesses, for integration tests."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest

from shared.client import ControlClient, new_event_id
from statesvc.tools.example import ExampleAssets
from shared.fleet import Computed, StateSvc


class Fleet:
    def __init__(self, tmp: Path, example: ExampleAssets, **svc_kw: Any) -> None:
        self.tmp, self.example = tmp, example
        self.statesvc = StateSvc(tmp / "data", **svc_kw)
        self.replicas: list[Computed] = []

    def replica(self, name: str, *, start: bool = True, args: tuple[str, ...] = ("--no-warmup",),
                env: dict[str, str] | None = None) -> Computed:
        r = Computed(self.example.model_dir, self.statesvc, self.tmp / "replicas" / name,
                     replica_id=name, extra_args=args, env=env or {})
        self.replicas.append(r)
        return r.start() if start else r

    def stop(self) -> None:
        for r in self.replicas:
            r.stop()
        self.statesvc.stop()

    def client(self) -> ControlClient:
        return ControlClient(self.statesvc.control)

    def cmd(self, cmd: str, **args: Any) -> Any:
        with self.client() as c:
            return c.call(cmd, {"event_id": new_event_id(), **args})

    def init(self, **kw: Any) -> None:
        self.cmd("pool.init", model=str(self.example.model_dir),
                 **{"max_loras": 6, "max_rank": 32, "targets": "all", **kw})

    def load(self, name: str, adapter: str, **kw: Any) -> Any:
        return self.cmd("load", name=name, path=str(self.example.adapter_dirs[adapter]), **kw)

    def head(self) -> int:
        with self.client() as c:
            return int(c.call("status")["head_seq"])

    def converged(self, *replicas: Computed) -> bool:
        head = self.head()
        return all(r.status()["applied_seq"] == head and r.status()["state"] == "ACTIVE"
                   for r in replicas)


@pytest.fixture
def fleet(tmp_path: Path, example: ExampleAssets) -> Iterator[Fleet]:
    f = Fleet(tmp_path, example)
    f.statesvc.start()
    try:
        yield f
    finally:
        f.stop()
