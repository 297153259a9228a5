"""Admission ports (computed/serving/admission.py) for an in-process Engine without a replica
behind it, shared by tests and benchmarks."""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any

from computed.serving.admission import AdmittedAdapter


class BaseOnly:
    """An admission port that serves the base model only: every request admitted at once."""

    def admit(self, adapter: str | None, min_seq: int, ticket: int = 0) -> AdmittedAdapter:
        return AdmittedAdapter(-1, None, 0, 0, None)

    def want(self, adapter: str | None) -> None:
        pass

    def withdraw(self, ticket: int) -> None:
        pass

    def reading(self) -> Any:
        return nullcontext(None)

    def pool_shapes(self) -> Any:
        return None
