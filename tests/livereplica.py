"""An in-process Replica against a real statesvc subprocess, warmed up, for compile counting."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from computed.replica import Replica
from shared.client import ControlClient, new_event_id
from shared.fingerprint import read_model
from statesvc.tools.example import ExampleAssets
from shared.fleet import StateSvc

Command = Callable[..., Any]


@contextmanager
def live_replica(tmp_path: Path, example: ExampleAssets,
                 max_loras: int) -> Iterator[tuple[Command, Replica]]:
    """Yield (cmd, replica): `cmd(command, **args)` writes to statesvc with a new event_id;
    the replica is bootstrapped and its slot write, clear and read have compiled."""
    svc = StateSvc(tmp_path / "data").start()
    try:
        with ControlClient(svc.control) as c:
            def cmd(command: str, **args: object) -> Any:
                return c.call(command, {"event_id": new_event_id(), **args})

            cmd("pool.init", model=str(example.model_dir), max_loras=max_loras, max_rank=32,
                targets="all")
            replica = Replica(read_model(example.model_dir), c, tmp_path / "replica")
            replica.bootstrap()
            # one diff at a time: applied together, a load and its unload cancel out and
            # would touch (and compile) nothing
            first = sorted(example.adapter_dirs)[0]
            cmd("load", name="warm", path=str(example.adapter_dirs[first]))
            replica.catch_up()
            replica.pool_digest()
            cmd("unload", name="warm")
            replica.catch_up()
            yield cmd, replica
    finally:
        svc.stop()
