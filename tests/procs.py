"""Real service subprocesses for tests: free loopback ports, started and stopped by pid."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_pid(proc: subprocess.Popen[Any], *, timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL; always reaps."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout)


@dataclass
class StateSvc:
    data_dir: Path
    control: str = field(default_factory=lambda: f"tcp://127.0.0.1:{free_port()}")
    publish: str = field(default_factory=lambda: f"tcp://127.0.0.1:{free_port()}")
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[Any] | None = None

    def start(self, *, timeout: float = 30.0) -> StateSvc:
        log = (self.data_dir.parent / f"statesvc-{self.data_dir.name}.log").open("ab")
        self.proc = subprocess.Popen(
            [str(BIN / "statesvc"), "serve", "--data-dir", str(self.data_dir),
             "--control", self.control, "--publish", self.publish, *self.extra_args],
            stdout=subprocess.PIPE, stderr=log, env={**os.environ, **self.env})
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode()
        if not line.startswith("READY") or time.monotonic() > deadline:
            self.stop()
            raise RuntimeError(f"statesvc did not start: {line!r}; see {log.name}")
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop_pid(self.proc)

    def kill(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


def loractl(state: StateSvc, *args: str, check: bool = True,
            timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Run the real loractl CLI against `state`."""
    res = subprocess.run([str(BIN / "loractl"), "--state", state.control, "--timeout", "5",
                          *args], capture_output=True, text=True, timeout=timeout)
    if check and res.returncode != 0:
        raise AssertionError(f"loractl {' '.join(args)} failed ({res.returncode}): {res.stderr}")
    return res
