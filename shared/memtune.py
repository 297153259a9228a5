"""glibc malloc settings for the long-running services (statesvc, computed serve).

Both services handle multi-MB buffers at every adapter load: a blob's received frame, its
joined chunks, the padded slot, a reply. glibc serves an allocation above its mmap threshold
(128 KiB at first, raised on the fly up to 32 MiB) with a fresh `mmap` and returns it with
`munmap` when freed, and it hands the top of its heap back to the kernel once more than its
trim threshold is free there; either way the next buffer of the same size starts on pages
the kernel must fault in and zero again. Measured on this project's CI box (a VM): a 2.2 MB
`bytes` join took 3.1 ms with 1,043 page faults, 0.12 ms with none once those pages were
kept; docs/postgres.md "Fifth look" has the figures on the served path.

`tune()` fixes both thresholds (which also turns glibc's own adjustment off): buffers up to
MMAP_THRESHOLD come from the heap and their pages are reused, and up to TRIM_THRESHOLD of
free heap stays mapped. The cost is resident memory: a service keeps the high-water mark of
its buffers (a few times its largest blob) instead of returning it between loads.

Left alone where the operator set glibc's malloc parameters themselves (GLIBC_TUNABLES with a
malloc setting, or a MALLOC_*_ variable), with LORAPLANE_MALLOC=default, and off glibc.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from collections.abc import Mapping

log = logging.getLogger("loraplane")

MMAP_THRESHOLD = 32 << 20  # allocations up to this come from the heap (glibc's highest)
TRIM_THRESHOLD = 256 << 20  # free heap kept mapped, up to this much
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)


def operator_set(environ: Mapping[str, str]) -> str | None:
    """Why the settings are left alone (the variable that says so), or None."""
    if environ.get("LORAPLANE_MALLOC", "") == "default":
        return "LORAPLANE_MALLOC=default"
    if "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES"
    return next((k for k in environ if k.startswith("MALLOC_") and k.endswith("_")), None)


def tune() -> bool:
    """Apply MMAP_THRESHOLD and TRIM_THRESHOLD to this process's glibc malloc; True if set."""
    if (why := operator_set(os.environ)) is not None:
        log.debug("malloc settings left as they are (%s)", why)
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        _ = libc.gnu_get_libc_version  # only glibc has it
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS): nothing to set
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) \
        and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def release() -> int:
    """Hand the free pages of every malloc arena back to the kernel (glibc's malloc_trim(0)),
    once a phase that freed much is over: a model load's per-tensor buffers (read, widened,
    packed, then freed) stay resident otherwise, kept by the thresholds above and by the
    heap's fragmentation. Returns the bytes the process's RSS shrank by (0 off glibc)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return 0
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    before = rss_bytes()
    trim(0)
    return max(0, before - rss_bytes())


def rss_bytes() -> int:
    """This process's resident set, from /proc/self/statm (0 where there is none)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
