"""Starting and stopping service processes by pid (demo, drills and tests)."""
from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import IO, Any, Sequence


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def loopback(port: int | None = None) -> str:
    return f"tcp://127.0.0.1:{port or free_port()}"


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie, killed and not yet reaped, is not alive)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def start_ready(argv: Sequence[str], *, log: Path, env: dict[str, str] | None = None,
                timeout: float = 60.0) -> tuple[subprocess.Popen[Any], str]:
    """Start a service that prints a `READY ...` line on stdout; returns it and that line."""
    log_file: IO[bytes] = log.open("ab")
    proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=log_file,
                            env={**os.environ, **(env or {})})
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    line = b""
    while time.monotonic() < deadline and proc.poll() is None:
        ready, _, _ = select.select([proc.stdout], [], [], 0.2)
        if ready:
            line = proc.stdout.readline()
            break
    if not line.startswith(b"READY"):
        stop_pid(proc)
        raise RuntimeError(f"{Path(argv[0]).name} did not start (exit {proc.poll()}); "
                           f"see {log}:\n{log.read_text()[-2000:]}")
    return proc, line.decode().strip()


def stop_pid(proc: subprocess.Popen[Any], *, timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after `timeout`; always reaps."""
    if proc.poll() is None:
        try:
            os.kill(proc.pid, signal.SIGTERM)
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout)
        except ProcessLookupError:
            pass
    if proc.stdout is not None:
        proc.stdout.close()
