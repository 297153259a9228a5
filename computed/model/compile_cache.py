"""The replica's persistent compilation cache, and the count of what a warm-up compiled.

A replica's warm-up compiles every prefill, chunk and decode shape it serves (computed/model/
warmup.py): at Qwen2.5-0.5B's geometry that is minutes of XLA on two CPUs, paid again on every
restart. With the cache, a restart reads the executables back from `<--cache-dir>/xla/<key>/`
instead (JAX's persistent compilation cache, which keys each entry by its HLO, the compile
options, the XLA flags and jax's version).

The directory's `key` adds what JAX's own key cannot see, so that no entry is ever reused across
them: jaxlib's version, the native kernels' build (its file is named by a hash of their sources,
flags and CPU: computed/backend/kernels), the LORAPLANE_* switches that change the compiled code,
the CPU, and the model's fingerprint and dtype. A new key starts an empty directory; older ones
beyond the newest `KEEP` are removed.

Where the environment already names a cache (JAX_COMPILATION_CACHE_DIR: `make test`'s session
cache, tests/conftest.py), the environment wins and the replica uses that one.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

log = logging.getLogger("computed.compile_cache")

ENV = "JAX_COMPILATION_CACHE_DIR"
SUBDIR = "xla"
KEEP = 4  # keyed directories kept in a cache dir: the newest, by last use
# the switches that change what a replica compiles (computed/backend/kernels)
SWITCHES = ("LORAPLANE_LORA_KERNEL", "LORAPLANE_KERNEL_ISA", "XLA_FLAGS")

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # every compile, a cache hit included
CACHE_HIT = "/jax/compilation_cache/cache_hits"


def key(*, fingerprint: str, dtype: str, tensor_parallel: int = 1) -> str:
    """The cache directory's name for this jax, kernel build, switches, CPU and model."""
    from jaxlib import version as jaxlib_version

    from computed.backend import kernels

    parts: list[str] = [jax.__version__, jaxlib_version.__version__, platform.machine(),
                        fingerprint, dtype, str(tensor_parallel), jax.default_backend()]
    parts += [f"{name}={os.environ.get(name, '')}" for name in SWITCHES]
    if kernels.available():
        parts.append(kernels.build().name)  # named by its sources, flags, compiler and CPU
    else:
        parts.append(f"no kernels: {kernels.unavailable_reason()}")
        parts.append(repr(kernels.built_isas()))
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def enable(cache_dir: Path, **model: Any) -> Path:
    """Point JAX's persistent compilation cache at `cache_dir/xla/<key>` (or the environment's,
    where JAX_COMPILATION_CACHE_DIR is set) before anything compiles; returns the directory."""
    env = os.environ.get(ENV)
    if env:
        log.info("compilation cache: %s (from %s)", env, ENV)
        return Path(env)
    root = cache_dir / SUBDIR
    path = root / key(**model)
    path.mkdir(parents=True, exist_ok=True)
    os.utime(path)
    others = sorted((p for p in root.iterdir() if p.is_dir() and p != path),
                    key=lambda p: p.stat().st_mtime, reverse=True)
    for stale in others[KEEP - 1:]:
        shutil.rmtree(stale, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # default: only compiles over 1 s
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    log.info("compilation cache: %s", path)
    return path


@dataclass
class Compiles:
    """XLA compiles in this process since `start`: all of them, and those the persistent cache
    served (`compiled` = the rest, which XLA really compiled)."""

    total: int = 0
    cache_hits: int = 0

    @property
    def compiled(self) -> int:
        return self.total - self.cache_hits


class CompileCounter:
    """Counts every compile of the process once `start`ed (thread-safe: the warm-up compiles on a
    thread of its own while the main thread serves status)."""

    def __init__(self) -> None:
        self.counts = Compiles()
        self._lock = threading.Lock()
        self._started = False

    def start(self) -> CompileCounter:
        if not self._started:
            jax.monitoring.register_event_duration_secs_listener(self._duration)
            jax.monitoring.register_event_listener(self._event)
            self._started = True
        return self

    def _duration(self, event: str, duration_secs: float, **kwargs: Any) -> None:
        if event == BACKEND_COMPILE:
            with self._lock:
                self.counts.total += 1

    def _event(self, event: str, **kwargs: Any) -> None:
        if event == CACHE_HIT:
            with self._lock:
                self.counts.cache_hits += 1

    def snapshot(self) -> Compiles:
        with self._lock:
            return Compiles(self.counts.total, self.counts.cache_hits)


COMPILES = CompileCounter()  # the process's one counter (the daemon's warm-up reads it)
