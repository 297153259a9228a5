"""The machine a result was taken on: its CPU, the ISAs it offers and those the kernels use."""
from __future__ import annotations

import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def _cpuinfo(*prefixes: str) -> str | None:
    """The value of the first /proc/cpuinfo line starting with one of `prefixes`."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(prefixes):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform module says."""
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def cpu_isas() -> list[str]:
    """The vector ISAs the CPU itself offers (from /proc/cpuinfo's flags), whatever a run forced:
    beside `kernel_isas` it tells a native AVX2 machine from an AVX-512 one capped at AVX2."""
    wanted = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512bf16", "asimd")
    have = set((_cpuinfo("flags", "Features") or "").split())
    return [f for f in wanted if f in have]


def isa_label(isas: list[str] | None) -> str:
    """The widest vector ISA the kernels were built for, as a reader names it."""
    have = set(isas or [])
    if "avx512f" in have:
        return "AVX-512" + (" (BF16)" if "avx512bf16" in have else "")
    if "avx2" in have:
        return "AVX2+FMA" if "fma" in have else "AVX2"
    return next(iter(sorted(have)), "no vector ISA").upper()


# What `--isa avx2` sets beside our kernels' forced build, so that everything else in the
# run (XLA's own ops, and torch under PEFT: ATen's kernels, oneDNN, MKL) also runs AVX2 code
# and the ratios are those of an AVX2 machine, not of our AVX2 code against AVX-512 peers.
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
            "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
AVX2_XLA_FLAG = "--xla_cpu_max_isa=AVX2"


def forced_isa_env(env: dict[str, str]) -> dict[str, str]:
    """`env` with the peers' and XLA's vector ISA capped at AVX2 (see AVX2_ENV)."""
    flags = env.get("XLA_FLAGS", "")
    if AVX2_XLA_FLAG not in flags:
        flags = f"{flags} {AVX2_XLA_FLAG}".strip()
    return {**env, **AVX2_ENV, "XLA_FLAGS": flags}


def machine_info() -> dict[str, Any]:
    """What a reader needs to compare runs: the CPU and the vector instruction sets the native
    kernels are built for here, Python, OS and when it ran."""
    from computed.backend.kernels import built_isas

    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "cpu": cpu_model(), "kernel_isas": built_isas(), "cpu_isas": cpu_isas(),
            "nproc": os.cpu_count(), "python": platform.python_version(),
            "implementation": sys.implementation.name, "platform": platform.platform(),
            "machine": platform.machine(),
            # set where a run capped everyone's ISA (`make bench ISA=avx2`)
            "isa_caps": {k: os.environ[k] for k in (*AVX2_ENV, "XLA_FLAGS") if k in os.environ}}

# `--isa avx2` (a forced AVX2+FMA build on any x86 CPU) keeps its results in RESULTS/avx2/,
# beside the native run's, and latest.json carries the figures of both
FORCED = "avx2"
