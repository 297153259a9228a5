"""shared/memtune.py: glibc's malloc thresholds set once per service, unless the operator set
them; measured on the served path in docs/postgres.md "Fifth look"."""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest

from shared import memtune


@pytest.mark.parametrize(("environ", "why"), [
    ({}, None),
    ({"PATH": "/bin", "GLIBC_TUNABLES": "glibc.rtld.nns=2"}, None),
    ({"LORAPLANE_MALLOC": "default"}, "LORAPLANE_MALLOC=default"),
    ({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=4096"}, "GLIBC_TUNABLES"),
    ({"MALLOC_ARENA_MAX": "2"}, None),  # not a glibc malloc variable: those end in "_"
    ({"MALLOC_TRIM_THRESHOLD_": "0"}, "MALLOC_TRIM_THRESHOLD_"),
])
def test_the_operators_settings_win(environ: dict[str, str], why: str | None) -> None:
    assert memtune.operator_set(environ) == why


def _glibc() -> bool:
    try:
        ctypes.CDLL(None).gnu_get_libc_version
    except AttributeError:
        return False
    return True


@pytest.mark.skipif(not _glibc(), reason="glibc's mallopt only")
def test_tune_sets_the_thresholds_in_a_fresh_process() -> None:
    code = "from shared import memtune; print(memtune.tune())"
    env = {k: v for k, v in os.environ.items() if k != "LORAPLANE_MALLOC"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, check=True).stdout
    off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**env, "LORAPLANE_MALLOC": "default"}, check=True).stdout
    assert (out.strip(), off.strip()) == ("True", "False")
