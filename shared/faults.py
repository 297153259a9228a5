"""Test-only fault injection: the one seam through which tests make services misbehave.

Crash and drill tests need a statesvc that leaves some diffs unpublished, a replica
that writes one slot wrong (a drill must catch it) and a replica that pauses after
each slot write (a window to SIGKILL it in). Each is switched on by an environment
variable, read once at start by `Faults.from_env`; production code asks the `Faults`
it was given at exactly one place per fault, and with no variable set every fault is
off and each call is a no-op.

    LORAPLANE_FAULT_DROP_DIFFS=3,5-7     statesvc: diffs of these seqs are not published
    LORAPLANE_FAULT_PERTURB_SLOT=1       replica: this slot's first A weight is nudged by 0.5
    LORAPLANE_FAULT_SLOW_WRITE_S=30      replica: a pause after each slot write
    LORAPLANE_FAULT_SLOW_STEP_S=0.02     replica: a pause after each inference step
    LORAPLANE_FAULT_SLOW_BLOB_S=2        statesvc: a pause before each blob chunk is read
    LORAPLANE_FAULT_SLOW_WARMUP_S=5      replica: its warm-up ends that much later (it stays "warming")
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, TypeVar

import numpy as np

DROP_DIFFS_ENV = "LORAPLANE_FAULT_DROP_DIFFS"
PERTURB_SLOT_ENV = "LORAPLANE_FAULT_PERTURB_SLOT"
SLOW_WRITE_ENV = "LORAPLANE_FAULT_SLOW_WRITE_S"
SLOW_STEP_ENV = "LORAPLANE_FAULT_SLOW_STEP_S"
SLOW_BLOB_ENV = "LORAPLANE_FAULT_SLOW_BLOB_S"
SLOW_WARMUP_ENV = "LORAPLANE_FAULT_SLOW_WARMUP_S"

log = logging.getLogger("faults")


class _Weights(Protocol):
    """What a slot write carries (computed.residency.pool.SlotWeights): (layer, module) -> (A, B)."""

    @property
    def pairs(self) -> Mapping[tuple[int, str], tuple[np.ndarray, np.ndarray]]: ...


W = TypeVar("W", bound=_Weights)


def parse_seq_set(spec: str) -> frozenset[int]:
    """"3,5-7" -> {3, 5, 6, 7}."""
    out: set[int] = set()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(out)


@dataclass(frozen=True)
class Faults:
    drop_diffs: frozenset[int] = frozenset()
    perturb_slot: int | None = None
    slow_write_s: float = 0.0
    slow_step_s: float = 0.0
    slow_blob_s: float = 0.0
    slow_warmup_s: float = 0.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Faults:
        """The faults the environment switches on; each one on is logged as a warning."""
        env = os.environ if env is None else env
        perturb = env.get(PERTURB_SLOT_ENV, "")
        faults = cls(drop_diffs=parse_seq_set(env.get(DROP_DIFFS_ENV, "")),
                     perturb_slot=int(perturb) if perturb else None,
                     slow_write_s=float(env.get(SLOW_WRITE_ENV, "") or 0.0),
                     slow_step_s=float(env.get(SLOW_STEP_ENV, "") or 0.0),
                     slow_blob_s=float(env.get(SLOW_BLOB_ENV, "") or 0.0),
                     slow_warmup_s=float(env.get(SLOW_WARMUP_ENV, "") or 0.0))
        for name, value in dataclasses.asdict(faults).items():
            if value:
                log.warning("test-only fault switch on: %s=%s", name, value)
        return faults

    def publishes(self, seq: int) -> bool:
        """statesvc: whether the diff of `seq` goes out."""
        if seq in self.drop_diffs:
            log.warning("fault switch: diff for seq %d left unpublished", seq)
            return False
        return True

    def write_slot(self, write: Callable[[int, W], Any], slot: int, weights: W) -> None:
        """A replica's slot write, `write(slot, weights)`, with this slot's faults applied."""
        if slot == self.perturb_slot:
            (first, (a, b)), *rest = sorted(weights.pairs.items())
            a = a.copy()
            a.flat[0] += 0.5
            weights = dataclasses.replace(weights,  # type: ignore[type-var]
                                          pairs=dict([(first, (a, b)), *rest]))
        write(slot, weights)
        if self.slow_write_s:
            time.sleep(self.slow_write_s)

    def after_step(self) -> None:
        """A replica's serving loop, after each engine step: streams stay mid-way long
        enough for a test to kill the replica under them."""
        if self.slow_step_s:
            time.sleep(self.slow_step_s)

    def after_warmup(self, stop: Callable[[], bool]) -> None:
        """A replica's warm-up, after its compiles: it stays "warming" long enough for a test to
        send requests that must wait for it (ended early by `stop()`)."""
        end = time.monotonic() + self.slow_warmup_s
        while time.monotonic() < end and not stop():
            time.sleep(0.05)

    def before_blob_read(self) -> None:
        """statesvc's blob thread, before each chunk is read."""
        if self.slow_blob_s:
            time.sleep(self.slow_blob_s)


NO_FAULTS = Faults()
