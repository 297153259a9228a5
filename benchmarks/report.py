"""Where benchmark results go: a JSON file under benchmarks/results/ and a README section.

A README section is the text between `<!-- bench:NAME:start -->` and
`<!-- bench:NAME:end -->`; `update_readme("NAME", markdown)` replaces it and
leaves the markers and everything else as they were.
"""
from __future__ import annotations

import json
import os
import platform
import re
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
RESULTS_DIR = REPO / "benchmarks" / "results"


def machine_info() -> dict[str, Any]:
    """What a reader needs to compare runs: CPUs, Python, OS and when it ran."""
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "nproc": os.cpu_count(),
            "python": platform.python_version(),
            "implementation": sys.implementation.name,
            "platform": platform.platform(),
            "machine": platform.machine()}


def median(values: list[float]) -> float:
    return float(statistics.median(values))


def write_results(name: str, data: dict[str, Any]) -> Path:
    """Write `data` as benchmarks/results/NAME.json; returns the path."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    return path


def update_readme(marker: str, markdown: str, *, readme: Path = README) -> bool:
    """Replace the text between the `bench:MARKER` markers; False when the markers are absent."""
    start, end = f"<!-- bench:{marker}:start -->", f"<!-- bench:{marker}:end -->"
    if not readme.is_file():
        return False
    text = readme.read_text()
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
    if not pattern.search(text):
        return False
    section = f"{start}\n{markdown.strip()}\n{end}"
    readme.write_text(pattern.sub(lambda _: section, text, count=1))
    return True
