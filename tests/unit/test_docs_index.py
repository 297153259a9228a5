"""The documentation holds together: docs/README.md lists every page, and every relative link
in README.md and docs/ names a file that exists (and, with #anchor, a heading in it)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
PAGES = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    """The ids GitHub gives a page's headings (lowercased, punctuation dropped, spaces to
    hyphens, a repeated one suffixed -1, -2, ...) and its own `<a id="...">` anchors."""
    seen: dict[str, int] = {}
    out = set(re.findall(r'<a id="([^"]+)">', page.read_text()))
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)  # not inside code blocks
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]  # http:, mailto:


def test_the_index_lists_every_page() -> None:
    index = (DOCS / "README.md").read_text()
    listed = set(re.findall(r"\]\(([\w.-]+\.md)\)", index))
    pages = {p.name for p in DOCS.glob("*.md")} - {"README.md"}
    assert pages - listed == set(), "add these pages to docs/README.md"
    assert listed - pages == set(), "docs/README.md lists pages that do not exist"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(target)
    assert broken == [], f"{page.relative_to(REPO)}: links to nothing: {broken}"
