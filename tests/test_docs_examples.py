"""What the README and docs give a newcomer to paste: the shipped sample prompts load as `bench` and `advise` read
them, every repository file an example names exists in a clone, and every markdown table has as many cells in each
row as its header (a row with more does not render as the table meant), with no escaped pipe inside a code span
(renderers differ there: some split the cell, some show the backslash)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from specdecode.advise.prompts import prompts_from_data
from specdecode.bench.data import load_prompts

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "examples" / "sample-prompts.jsonl"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CELL_BORDER = re.compile(r"(?<!\\)\|")  # GitHub's tables: a backslash keeps a pipe inside a cell


def test_the_sample_prompts_load_for_bench_and_advise():
    prompts = load_prompts([str(SAMPLE)])
    assert len(prompts) == 12 and all(p.chat for p in prompts)
    assert {p.category for p in prompts} == {"code", "chat", "translation", "summary", "qa"}
    assert len({p.id for p in prompts}) == 12
    assert [p.turns for p in prompts_from_data([str(SAMPLE)])] == [p.turns for p in prompts]


def test_example_files_in_the_docs_exist():
    named = {match for doc in DOCS for match in re.findall(r"\bexamples/[\w./-]+\w", doc.read_text())}
    assert named, "no example file named: the docs should point at examples/sample-prompts.jsonl"
    assert all((ROOT / name).is_file() for name in named), sorted(n for n in named if not (ROOT / n).is_file())


def tables(text: str) -> list[list[str]]:
    blocks, block = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            block.append(line)
        elif block:
            blocks.append(block)
            block = []
    return blocks


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: path.name)
def test_every_table_row_has_the_header_s_cells(doc):
    for block in tables(doc.read_text()):
        counts = [len(CELL_BORDER.split(line.strip().strip("|"))) for line in block]
        assert len(set(counts)) == 1, f"{doc.name}: a table's rows have {counts} cells:\n{block[0][:120]}"
        piped = [span for line in block for span in re.findall(r"`[^`]*\\\|[^`]*`", line)]
        assert not piped, f"{doc.name}: a pipe inside code in a table: {piped}"
