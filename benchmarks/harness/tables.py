"""Markdown tables, and the marked sections of a markdown file they are written into.

A section is the text between `<!-- bench:NAME:start -->` and `<!-- bench:NAME:end -->`;
`update_section(path, "NAME", markdown)` replaces it and leaves the markers and everything else
as they were. `tables_file` finds them wherever they are: today the README's headline
(`bench:headline`) in README.md, the table of every figure (`bench:summary`) in docs/results.md
and each bench's own section (`bench:NAME`) in docs/results-detail.md; moving one needs no
change here.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from benchmarks.harness.machine import REPO


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"


def tables_file(name: str = "summary", root: Path = REPO) -> Path:
    """The markdown file holding the `bench:NAME` markers: README.md, or else the first page of
    docs/ that has them (README.md where none has)."""
    start = _markers(name)[0]
    for path in (root / "README.md", *sorted((root / "docs").glob("*.md"))):
        if path.is_file() and start in path.read_text():
            return path
    return root / "README.md"


def update_section(path: Path, name: str, markdown: str) -> bool:
    """Replace the text between `path`'s `bench:NAME` markers; False where it has none."""
    start, end = _markers(name)
    if not path.is_file():
        return False
    text = path.read_text()
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
    if not pattern.search(text):
        return False
    path.write_text(pattern.sub(lambda _: f"{start}\n{markdown.strip()}\n{end}", text, count=1))
    return True


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    """A markdown table's lines: the first column left-aligned, the others right-aligned."""
    return ["| " + " | ".join(columns) + " |", "|---" + "|---:" * (len(columns) - 1) + "|",
            *("| " + " | ".join(str(c) for c in row) + " |" for row in rows)]
