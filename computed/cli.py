"""computed: the replica daemon (built by the compute daemon issue)."""
from __future__ import annotations


def main() -> None:
    raise SystemExit("computed: not built yet")
