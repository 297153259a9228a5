"""Real service subprocesses for tests: free loopback ports, started and stopped by pid."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.processes import free_port, loopback, start_ready, stop_pid
from shared.replica_protocol import STATUS

BIN = Path(sys.executable).parent
__all__ = ["BIN", "Computed", "StateSvc", "free_port", "loractl", "stop_pid", "wait_for"]


class _Process:
    """Stop (SIGTERM, then SIGKILL) or kill a started service, always by its pid."""

    proc: subprocess.Popen[Any] | None

    def stop(self) -> None:
        if self.proc is not None:
            stop_pid(self.proc)

    def kill(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


@dataclass
class StateSvc(_Process):
    data_dir: Path
    control: str = field(default_factory=loopback)
    publish: str = field(default_factory=loopback)
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    wrapper: tuple[str, ...] = ()  # a command that execs statesvc (setpriv, prlimit ...)
    proc: subprocess.Popen[Any] | None = None

    @property
    def log(self) -> Path:
        return self.data_dir.parent / f"statesvc-{self.data_dir.name}.log"

    def start(self) -> StateSvc:
        self.proc, _ = start_ready(
            [*self.wrapper, str(BIN / "statesvc"), "serve", "--data-dir", str(self.data_dir),
             "--control", self.control, "--publish", self.publish, *self.extra_args],
            log=self.log, env=self.env)
        return self



def loractl(state: StateSvc, *args: str, check: bool = True,
            timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Run the real loractl CLI against `state`."""
    res = subprocess.run([str(BIN / "loractl"), "--state", state.control, "--timeout", "5",
                          *args], capture_output=True, text=True, timeout=timeout)
    if check and res.returncode != 0:
        raise AssertionError(f"loractl {' '.join(args)} failed ({res.returncode}): {res.stderr}")
    return res


@dataclass
class Computed(_Process):
    """A `computed serve` subprocess following `state`."""

    model_dir: Path
    state: StateSvc
    cache_dir: Path
    listen: str = field(default_factory=loopback)
    replica_id: str | None = None
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[Any] | None = None

    @property
    def log(self) -> Path:
        return self.cache_dir.parent / f"computed-{self.cache_dir.name}.log"

    def start(self) -> Computed:
        self.cache_dir.parent.mkdir(parents=True, exist_ok=True)
        self.proc, _ = start_ready(
            [str(BIN / "computed"), "serve", "--model", str(self.model_dir), "--state",
             self.state.control, "--diffs", self.state.publish, "--listen", self.listen,
             "--cache-dir", str(self.cache_dir),
             *(["--replica-id", self.replica_id] if self.replica_id else []),
             *self.extra_args],
            log=self.log, env=self.env)
        return self


    def call(self, cmd: str, **args: Any) -> Any:
        from shared.client import ControlClient
        with ControlClient(self.listen, timeout_s=10, retries=0) as c:
            return c.call(cmd, args)

    def status(self) -> dict[str, Any]:
        return dict(self.call(STATUS))


def wait_for(predicate: Any, *, timeout: float = 60.0, what: str = "condition") -> None:
    """Poll until `predicate()` is true; a generous bound that only guards against hangs."""
    import time
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")
