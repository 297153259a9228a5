"""The admission port: all that serving (computed/serving/engine.py) asks of the replica.

The engine admits a request by `admit(adapter, min_seq, ticket)`: the replica resolves
the adapter to its registered version, makes it resident in a slot if it is not
(computed/residency/manager.py `make_resident`) and leases the slot (so it is not
overwritten until the request finishes, see computed/residency/pool.py), or refuses
with a coded error. The forward pass reads the pool's arrays through `reading`,
and warm-up compiles from `pool_shapes`. The replica (computed/replica.py)
implements the port; the engine imports nothing else of it, nor the replica
anything of the engine.

The seam `AdmissionPort`: what may cross it is in this module and nothing else. Into the
replica: an adapter name (None: the base model), a min_seq, a request's ticket (its age in
the queue). Out of it: an `AdmittedAdapter` (slot, adapter version, seq, the slot's lease),
the pool's arrays as a `LoraPool` inside `reading()`, or the coded refusals below
(`GenerateError`, `NotReady`, and `SlotDraining`, `NoSlot`, `Fetching`: wait and retry).
No replica state, slot map or blob crosses it.
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

from computed.residency.pool import Lease, LoraPool, SlotDraining
from shared.errors import CodedError
from shared.prefix import BASE_ROOT

# what the engine needs of the pool comes through here: its arrays' type (the forward pass's
# input) and the refusal of a slot being rewritten
__all__ = ["AdmissionPort", "Fetching", "GenerateError", "AdmittedAdapter", "LoraPool", "NoSlot",
           "NotReady", "SlotDraining"]


class GenerateError(CodedError):
    """A generate request refused or failed; the reply carries its code, message and field."""


class NotReady(GenerateError):
    """The replica is not serving yet, or has not applied `min_seq`: the engine waits for it
    up to its --min-seq-timeout, then answers `not_ready`."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__("not_ready", message, field)


class NoSlot(SlotDraining):
    """No slot can hold the request's adapter now (all leased, pinned or reserved): it waits
    in the queue and is admitted when a lease ends (docs/residency.md)."""


class Fetching(SlotDraining):
    """The adapter's weights are being fetched and parsed (computed/residency/host_tier.py): the request
    waits in the queue. `wait(timeout_s)` blocks until that fetch ends (True) or the timeout
    passes (False): the engine may wait a little for it rather than a whole decode step."""

    def __init__(self, message: str, wait: Callable[[float], bool] | None = None) -> None:
        super().__init__(message)
        self.wait = wait


@dataclass(frozen=True)
class AdmittedAdapter:
    """An admitted request's hold on the replica, until `release`."""

    slot: int  # -1: the base model
    name: str | None  # the adapter, None for the base model
    version: int  # the adapter's version the request runs on (0 for the base model)
    seq: int  # the replica's applied seq at admission
    lease: Lease | None  # the hold on `slot`, None for the base model
    # the prefix cache's key for this version's content (shared/prefix.py `content_root`)
    root: str = BASE_ROOT

    def release(self) -> None:
        if self.lease is not None:
            self.lease.pool.release(self.lease)


class AdmissionPort(Protocol):
    def admit(self, adapter: str | None, min_seq: int, ticket: int = 0) -> AdmittedAdapter:
        """Admit a request for `adapter` (None: the base model) once `min_seq` is applied;
        raises NotReady or SlotDraining (NoSlot among them; all: try again later), or
        GenerateError. `ticket` orders the requests that wait for a slot: older, smaller."""
        ...

    def want(self, adapter: str | None) -> None:
        """A request for `adapter` was queued: start making it resident if it is not (the
        fetch and parse run beside the decode steps; admission then writes the slot)."""
        ...

    def withdraw(self, ticket: int) -> None:
        """Request `ticket` left the queue without being admitted (refused, timed out): it
        no longer waits for a slot."""
        ...

    def reading(self) -> AbstractContextManager[LoraPool]:
        """The pool's arrays, held unchanged while the block dispatches the forward pass."""
        ...

    def pool_shapes(self) -> LoraPool | None:
        """The pool's shapes and dtypes for compiling, None until the pool is configured."""
        ...
