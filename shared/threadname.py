"""The OS name of a service's own threads, so `top -H`, `ps -L` and /proc/PID/task/*/comm
tell them apart (Python 3.11 names a thread only for Python itself: every thread of
`computed serve` shows as "computed" there). benchmarks/bench_pg.py splits each process's
CPU by these names.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading

_PR_SET_NAME = 15  # prctl(2)
_MAX = 15  # the kernel keeps 15 bytes of a thread's name


def name_os_thread() -> None:
    """Give the calling thread its Python name (`threading.current_thread().name`) at the OS
    level too, cut to 15 bytes; Linux only, a no-op elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.prctl(_PR_SET_NAME, threading.current_thread().name.encode()[:_MAX], 0, 0, 0)
    except (OSError, AttributeError):
        pass
