"""Counting XLA compilations and pool buffer addresses (tests and benchmarks)."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import jax

from computed.residency.pool import MemoryPool

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


@contextmanager
def counting_compiles() -> Iterator[list[str]]:
    """Collect one entry per XLA backend compile while the block runs."""
    seen: list[str] = []

    def listener(event: str, duration_secs: float, **kwargs: str | int) -> None:
        if event == BACKEND_COMPILE:
            seen.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def buffer_pointers(pool: MemoryPool) -> list[int]:
    return [a.unsafe_buffer_pointer() for a in jax.tree.leaves(pool.arrays)]
