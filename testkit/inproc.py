"""The state service's core in-process, over a real SQLite file and blob store, or a real
PostgreSQL database (no sockets)."""
from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from shared.client import new_event_id
from shared.protocol import COMMANDS, WRITE_COMMANDS, Request, validate
from statesvc.decisions import CommandError
from statesvc.persistence import open_log, sqlite_url
from statesvc.service import StateService


def open_service(data_dir: Path, *, snapshot_every: int = 100,
                 db_url: str | None = None) -> StateService:
    """Over SQLite in `data_dir`, or over the PostgreSQL database at `db_url` (blobs in it)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    store, blobs = open_log(db_url or sqlite_url(data_dir), blobs_dir=data_dir / "blobs")
    return StateService(store, blobs, snapshot_every=snapshot_every)


def request(cmd: str, **args: Any) -> Request:
    if cmd in WRITE_COMMANDS:
        args.setdefault("event_id", new_event_id())
    return Request(uuid.uuid4().hex, cmd, validate(COMMANDS[cmd], args, "args"))


def call(service: StateService, cmd: str, **args: Any) -> Any:
    """Run one command; returns its result or raises its CommandError."""
    [answer], _ = service.handle([(request(cmd, **args), "test")])
    if answer.error is not None:
        raise answer.error
    return answer.result


def init_pool(service: StateService, model_dir: Path, **overrides: Any) -> Any:
    args = {"model": str(model_dir), "max_loras": 4, "max_rank": 16, "targets": "all"}
    return call(service, "pool.init", **{**args, **overrides})


__all__ = ["CommandError", "call", "init_pool", "open_service", "request"]
