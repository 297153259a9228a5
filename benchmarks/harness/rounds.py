"""The order of the sides of a comparison, round by round, and the wait for them to go idle.

Two sides timed one after the other in a round share whatever the machine does then; which goes
first alternates by round, so that neither always follows the other's leftovers (a warm cache,
a busy-polling worker)."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def alternate(sides: Sequence[T], i: int) -> list[T]:
    """The sides in round `i`'s order: as given on odd rounds, reversed on even ones (round 0,
    the warm-up, runs the last one first)."""
    return list(sides) if i % 2 else list(sides)[::-1]


def settle(cpu_s: Callable[[], float], *, window: float = 0.5, idle: float = 0.05,
           timeout: float = 10.0) -> float:
    """Wait until the processes `cpu_s` sums the CPU seconds of use under `idle` of a CPU over
    `window` seconds; the seconds that took (at most `timeout`)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        before = cpu_s()
        time.sleep(window)
        if cpu_s() - before < idle * window:
            break
    return time.perf_counter() - t0
