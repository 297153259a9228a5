"""A bench's fleet: statesvc, its replicas and a gateway as real subprocesses (testkit/fleet.py).

`Fleet.start` starts statesvc, initialises the pool, loads the adapters through it, starts the
replicas (and the gateway), and waits until the replicas applied every load (the gateway is
healthy); `stop` stops what it started, by pid, the gateway first. As a context manager it
stops them even where the bench fails:

    with Fleet(root, model_dir, adapters=dirs, max_loras=16, max_rank=8, gateway=()) as fleet:
        httpx.post(fleet.url + "/v1/completions", ...)
"""
from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from shared.client import ControlClient, new_event_id
from testkit.fleet import Computed, Gateway, StateSvc, cpu_seconds, wait_for


class Fleet:
    def __init__(self, root: Path, model_dir: Path, *, max_loras: int, max_rank: int,
                 adapters: Mapping[str, Path] | None = None, pool: Mapping[str, Any] | None = None,
                 replicas: int = 1, replica_args: Sequence[str] = (), gateway: Sequence[str] | None = None,
                 wrapper: Sequence[str] = (), replica_wrapper: Sequence[str] | None = None,
                 gateway_wrapper: Sequence[str] | None = None, statesvc_args: Sequence[str] = (),
                 name: str = "") -> None:
        """`gateway`: the gateway's arguments (None: no gateway); `pool`: more of pool.init's
        arguments (dtype ...); `wrapper`: the command every process is started under (taskset),
        `replica_wrapper` and `gateway_wrapper` theirs where it differs."""
        self.model_dir, self.adapters = model_dir, dict(adapters or {})
        self.pool = {"model": str(model_dir), "max_loras": max_loras, "max_rank": max_rank,
                     "targets": "all", **(pool or {})}
        prefix = f"{name}-" if name else ""
        wrap = tuple(wrapper)
        self.svc = StateSvc(root / f"{prefix}data", wrapper=wrap, extra_args=tuple(statesvc_args))
        self.replicas = [Computed(model_dir, self.svc, root / f"{prefix}replicas" / f"r{i + 1}",
                                  replica_id=f"r{i + 1}", extra_args=tuple(replica_args),
                                  wrapper=wrap if replica_wrapper is None else tuple(replica_wrapper))
                         for i in range(replicas)]
        self.gateway = None if gateway is None else Gateway(
            model_dir, self.svc, log_file=root / f"{prefix}gateway.log", extra_args=tuple(gateway),
            wrapper=wrap if gateway_wrapper is None else tuple(gateway_wrapper))
        self.seq = 0
        self.control: ControlClient | None = None  # statesvc's, open from start to stop

    @property
    def replica(self) -> Computed:
        return self.replicas[0]

    @property
    def url(self) -> str:
        assert self.gateway is not None, "a fleet without a gateway"
        return self.gateway.url

    def command(self, command: str, **args: Any) -> Any:
        """One control command to statesvc, with a fresh event id, on the fleet's one connection
        (a timed command pays no connection set-up)."""
        assert self.control is not None, "the fleet is not started"
        return self.control.call(command, {"event_id": new_event_id(), **args})

    def start(self, timeout: float = 300.0) -> float:
        """Start everything (see the module's docstring); the seconds until it is ready. A
        failure stops what had started."""
        t0 = time.perf_counter()
        try:
            self.svc.start()
            self.control = ControlClient(self.svc.control, timeout_s=60)
            self.seq = int(self.command("pool.init", **self.pool)["seq"])
            for name, path in self.adapters.items():
                self.seq = int(self.command("load", name=name, path=str(path))["seq"])
            for r in self.replicas:
                r.start()
            if self.gateway is not None:
                self.gateway.start()
                wait_for(self.gateway.healthy, timeout=timeout, what="gateway healthy")
            for r in self.replicas:
                wait_for(lambda r=r: int(r.status()["applied_seq"]) >= self.seq,  # type: ignore[misc]
                         timeout=timeout, what=f"replica {r.replica_id} to apply the loads")
        except BaseException:
            self.stop()
            raise
        return time.perf_counter() - t0

    def pids(self) -> dict[str, int]:
        """The started processes' pids, by role (`statesvc`, `r1` ..., `gateway`)."""
        procs = {"statesvc": self.svc, **{r.replica_id or "": r for r in self.replicas},
                 **({"gateway": self.gateway} if self.gateway is not None else {})}
        return {k: p.pid for k, p in procs.items() if p.proc is not None}

    def cpu_s(self) -> float:
        """CPU seconds so far of every process of the fleet."""
        return sum(cpu_seconds(pid) for pid in self.pids().values())

    def logs(self, chars: int = 1500) -> str:
        """The last `chars` of each replica's log: what a failed bench prints."""
        return "\n".join(f"{r.log} (last lines):\n{r.log.read_text()[-chars:]}" for r in self.replicas
                         if r.log.is_file())

    def stop(self) -> None:
        if self.control is not None:
            self.control.close()
            self.control = None
        for p in (self.gateway, *reversed(self.replicas), self.svc):
            if p is not None and p.proc is not None:
                p.stop()

    def __enter__(self) -> Fleet:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
