"""The tests' and benchmarks' fleet: the production launcher (statesvc/tools/processes.py:
statesvc, replicas and the gateway as subprocesses, stopped by pid) re-exported, plus what
only tests and benchmarks use: `loractl` run against a started statesvc (it fails the test on
a non-zero exit), and what /proc says of a process (CPU seconds, per thread, memory)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

from statesvc.tools.processes import (BIN, Addresses, Computed, Endpoints, Gateway, StateSvc,
                                      alive, free_port, loopback, start_ready, stop_pid,
                                      wait_for)

__all__ = ["BIN", "Addresses", "Computed", "Endpoints", "Gateway", "StateSvc", "alive",
           "cpu_seconds", "free_port", "loopback", "loractl", "memory_kb", "start_ready",
           "stop_pid", "thread_cpu", "wait_for"]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds `pid` has used so far, every thread (/proc/PID/stat, in clock
    ticks of 10 ms); NaN where /proc cannot say (off Linux, or the process has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return _stat_cpu(f.read())
    except OSError:
        return float("nan")


def _stat_cpu(stat: str) -> float:
    """utime + stime of a /proc/.../stat line, in seconds."""
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of `pid`'s threads so far, summed by thread name (/proc/PID/task/*)."""
    out: dict[str, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # ended meanwhile
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        out[name] = out.get(name, 0.0) + _stat_cpu(stat)
    return out


def memory_kb(pid: int, field: str) -> int:
    """A size /proc/PID/status gives in kB (`VmRSS`, `VmHWM`, ...); KeyError if it has none."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(f"/proc/{pid}/status has no {field}")


def loractl(state: StateSvc, *args: str, check: bool = True,
            timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Run the real loractl CLI against `state`."""
    res = subprocess.run([str(BIN / "loractl"), "--state", state.control, "--timeout", "5",
                          *args], capture_output=True, text=True, timeout=timeout)
    if check and res.returncode != 0:
        raise AssertionError(f"loractl {' '.join(args)} failed ({res.returncode}): {res.stderr}")
    return res
