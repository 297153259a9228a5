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

BIN = Path(sys.executable).parent
__all__ = ["BIN", "StateSvc", "free_port", "loractl", "stop_pid"]


@dataclass
class StateSvc:
    data_dir: Path
    control: str = field(default_factory=loopback)
    publish: str = field(default_factory=loopback)
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[Any] | None = None

    @property
    def log(self) -> Path:
        return self.data_dir.parent / f"statesvc-{self.data_dir.name}.log"

    def start(self) -> StateSvc:
        self.proc, _ = start_ready(
            [str(BIN / "statesvc"), "serve", "--data-dir", str(self.data_dir), "--control",
             self.control, "--publish", self.publish, *self.extra_args],
            log=self.log, env=self.env)
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
