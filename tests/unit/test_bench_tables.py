"""The figures in README.md and docs/results.md are what `make bench` wrote from
benchmarks/results/latest.json, never typed by hand; and the suite writes each table where it
belongs (docs/results.md every figure, the README its headline)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks.harness import OUT_ENV, REPO, RESULTS_DIR, publish, tables_file, update_section
from benchmarks.harness.output import section_file
from benchmarks.harness.records import HEADLINE, headline_table, summary_table
from benchmarks.suite import BENCHES, copy_tables_files, write_tables

README, RESULTS_DOC, DETAIL_DOC = REPO / "README.md", REPO / "docs" / "results.md", REPO / "docs" / "results-detail.md"


def _block(text: str, marker: str) -> str:
    match = re.search(rf"<!-- bench:{marker}:start -->\n(.*?)\n<!-- bench:{marker}:end -->", text, re.DOTALL)
    assert match, f"no bench:{marker} markers"
    return match.group(1)


def _latest() -> dict:
    return json.loads((RESULTS_DIR / "latest.json").read_text())


def test_the_committed_tables_are_the_generators_output_of_latest_json() -> None:
    latest = _latest()
    assert _block(RESULTS_DOC.read_text(), "summary") == summary_table(latest)
    assert _block(README.read_text(), "headline") == headline_table(latest)


def test_every_headline_figure_is_a_figure_the_benchmarks_make() -> None:
    # a renamed figure would drop out of the README silently
    names = {f["name"] for f in _latest()["figures"]}
    assert [n for n in HEADLINE if n not in names] == []
    block = _block(README.read_text(), "headline")
    for name in HEADLINE:
        assert f"| {name} |" in block, name


def test_each_table_has_one_home() -> None:
    def sections(doc: Path) -> list[str]:
        return re.findall(r"<!-- bench:([a-z_]+):start -->", doc.read_text())

    assert sections(README) == ["headline"]
    assert sections(RESULTS_DOC) == ["summary"]
    # every benchmark the suite runs has its section on the detail page, once
    detail = sections(DETAIL_DOC)
    assert sorted(detail) == sorted(set(detail))
    assert {b.name for b in BENCHES} <= set(detail)
    # and tables_file finds each where it lives, so the suite and the benches write there
    assert tables_file("headline") == README
    assert tables_file("summary") == RESULTS_DOC
    assert {tables_file(b.name) for b in BENCHES} == {DETAIL_DOC}


def test_a_run_with_out_copies_every_file_holding_markers(tmp_path: Path) -> None:
    copy_tables_files(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md", "results-detail.md", "results.md"]
    for page in (README, RESULTS_DOC, DETAIL_DOC):
        assert (tmp_path / page.name).read_text() == page.read_text()


def test_tables_go_to_their_own_files_and_sections_to_whichever_holds_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    readme, results, detail = (tmp_path / p.name for p in (README, RESULTS_DOC, DETAIL_DOC))
    readme.write_text("intro\n<!-- bench:headline:start -->\nold\n<!-- bench:headline:end -->\ntail\n")
    results.write_text("<!-- bench:summary:start -->\nold\n<!-- bench:summary:end -->\n")
    detail.write_text("<!-- bench:decode:start -->\nold\n<!-- bench:decode:end -->\n")
    latest = _latest()
    write_tables(latest, readme, results)
    assert _block(readme.read_text(), "headline") == headline_table(latest)
    assert readme.read_text().startswith("intro\n") and readme.read_text().endswith("tail\n")
    assert _block(results.read_text(), "summary") == summary_table(latest)
    assert _block(detail.read_text(), "decode") == "old"  # a section the suite does not write
    # a benchmark's own section (as `python -m benchmarks --out DIR` points it): written in
    # the copy of the file that holds its markers; none holding them is said
    monkeypatch.setenv(OUT_ENV, str(tmp_path))
    said: list[str] = []
    publish("decode", {"figures": []}, "new decode", quick=True, no_write=False, say=said.append)
    assert _block(detail.read_text(), "decode") == "new decode"
    assert json.loads((tmp_path / "decode.json").read_text()) == {"figures": []}
    assert said[-1] == "results-detail.md section bench:decode updated"
    assert section_file("headline") == readme
    assert update_section(section_file("headline"), "headline", "new headline")
    assert _block(readme.read_text(), "headline") == "new headline"
    assert not update_section(section_file("nothing"), "nothing", "x")


def test_a_run_without_headline_figures_says_so() -> None:
    latest = {**_latest(), "figures": []}
    assert "No headline figure" in headline_table(latest)
