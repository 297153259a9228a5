"""Medians, percentiles and spreads, and the per-round timing of a side of a comparison.

A `Timing` keeps, per timed round, the wall seconds, the share of the CPUs this process used and
the share other processes used (/proc/stat); a round where others used over `CONTENDED` of the
CPUs in any side's measurement does not count (`clean_rounds`): torch's threads in particular
slow down many times over when one of them is descheduled.
"""
from __future__ import annotations

import os
import statistics
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

CONTENDED = 0.10  # a share of the CPUs used by other processes above this spoils a round


def median(values: Iterable[float]) -> float:
    return float(statistics.median(values))


def percentile(values: Sequence[float], q: float) -> float:
    """The `q`th percentile of `values` (numpy's, interpolated between the nearest two)."""
    import numpy as np

    return float(np.percentile(np.asarray(values), q))


def spread(values: list[float]) -> list[float]:
    """[min, max] of the runs behind a median: how far apart the repeats landed."""
    return [float(min(values)), float(max(values))]


def decode_rates(cell: dict[str, Any], tokens: int) -> list[float]:
    """tokens/s of the rounds a decode figure is taken from (`used_rounds`; None: all)."""
    used = cell.get("used_rounds")
    return [tokens / cell["seconds"][i] for i in (range(len(cell["seconds"])) if used is None else used)]


def busy_seconds() -> float:
    """CPU seconds the whole machine has been busy since boot (every process); NaN off Linux."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return float("nan")
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # less idle and iowait


@dataclass
class Timing:
    """Per timed round of `rows` sequences: seconds, the share of the CPUs this process used,
    and the share others used."""

    seconds: list[float] = field(default_factory=list)
    cpu_share: list[float] = field(default_factory=list)
    others_share: list[float] = field(default_factory=list)
    used: list[int] | None = None  # the rounds the figure is taken from; None: all
    rows: int = 32

    def rounds(self) -> list[int]:
        return list(range(len(self.seconds))) if self.used is None else self.used

    def rates(self, steps: int) -> list[float]:
        """tokens/s of each round the figure is taken from."""
        return [self.rows * steps / self.seconds[i] for i in self.rounds()]

    def tokens_per_s(self, steps: int) -> float:
        return self.rows * steps / median([self.seconds[i] for i in self.rounds()])

    def add(self, other: Timing) -> None:
        self.seconds += other.seconds
        self.cpu_share += other.cpu_share
        self.others_share += other.others_share

    def clean(self, i: int) -> bool:
        """Whether other processes left the CPUs alone during round i (NaN off Linux counts as clean)."""
        return not self.others_share[i] > CONTENDED

    def as_dict(self, steps: int) -> dict[str, Any]:
        return {"tokens_per_s": self.tokens_per_s(steps), "tokens_per_s_spread": spread(self.rates(steps)),
                "seconds": self.seconds,
                "cpu_share": self.cpu_share, "others_share": self.others_share, "used_rounds": self.used}


def clean_rounds(timings: list[Timing], rounds: int) -> list[int]:
    """The rounds no side's measurement shared the CPUs with other load in."""
    return [i for i in range(rounds) if all(t.clean(i) for t in timings)]


def paired(a: Timing, b: Timing) -> tuple[float, list[float]]:
    """a's speed over b's: the median and the spread of the per-round ratios of the rounds both
    count (each round times every side of the comparison)."""
    both = [i for i in a.rounds() if i in b.rounds()]
    per_round = [b.seconds[i] / a.seconds[i] for i in both]
    return median(per_round), spread(per_round)


@contextmanager
def timed(timing: Timing | None) -> Iterator[None]:
    """Time the block into `timing` (None: run it untimed, a warm-up)."""
    wall, cpu, busy = time.perf_counter(), time.process_time(), busy_seconds()
    yield
    if timing is not None:
        wall = time.perf_counter() - wall
        cpu = time.process_time() - cpu
        capacity = wall * (os.cpu_count() or 1)
        timing.seconds.append(wall)
        timing.cpu_share.append(cpu / capacity)
        timing.others_share.append(max(0.0, busy_seconds() - busy - cpu) / capacity)
