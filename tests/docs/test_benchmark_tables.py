"""The docs' benchmark tables are what the benchmarks printed: each table follows a marker
`<!-- recorded: benchmark_runs/NAME.txt -->` naming the file benchmarks/record.py kept of that run, and is one of
that file's tables as printed, whole and in order. Every table of docs/benchmarks.md has a marker, and every kept
run is quoted somewhere (a rerun replaces the file, and then the tables must follow)."""

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
MARKER = re.compile(r"^<!-- recorded: (benchmark_runs/[\w.-]+\.txt) -->$")


def blocks(lines: list[str]) -> list[tuple[int, list[str]]]:
    """(index of the first line, lines) of each table in LINES: a run of lines that start with `|` (indented ones too:
    markdown still draws them, so they must be checked)."""
    found, i = [], 0
    while i < len(lines):
        if lines[i].lstrip().startswith("|"):
            start = i
            while i < len(lines) and lines[i].lstrip().startswith("|"):
                i += 1
            found.append((start, lines[start:i]))
        i += 1
    return found


def tables(page: Path) -> list[tuple[int, str | None, list[str]]]:
    """(line number, recorded file named by the marker above it or None, lines) for each table of PAGE."""
    lines = page.read_text().splitlines()
    found = []
    for start, rows in blocks(lines):
        above = start - 1
        while above >= 0 and not lines[above].strip():
            above -= 1
        marker = MARKER.match(lines[above]) if above >= 0 else None
        found.append((start + 1, marker.group(1) if marker else None, rows))
    return found


def quoted() -> list[tuple[Path, int, str, list[str]]]:
    pages = [*DOCS.rglob("*.md"), ROOT / "README.md"]
    return [(page, n, name, rows) for page in pages for n, name, rows in tables(page) if name]


def test_every_benchmark_table_names_its_recorded_run():
    bare = [f"docs/benchmarks.md:{n}" for n, name, _ in tables(DOCS / "benchmarks.md") if name is None]
    assert bare == []


@pytest.mark.parametrize(
    ("page", "line", "name", "rows"), [pytest.param(*q, id=f"{q[0].name}:{q[1]}") for q in quoted()]
)
def test_a_quoted_table_is_the_recorded_output(page, line, name, rows):
    recorded = DOCS / name
    assert recorded.is_file(), f"{page.name}:{line} quotes {name}, which does not exist"
    printed = [table for _, table in blocks(recorded.read_text().splitlines())]
    # one whole table as printed: no row dropped, added, moved or borrowed from another of the file's tables
    assert rows in printed, f"{page.name}:{line}: this table is none of {name}'s tables as printed"


def test_every_recorded_run_is_quoted_and_names_a_benchmark():
    names = {name for _, _, name, _ in quoted()}
    for path in sorted((DOCS / "benchmark_runs").glob("*.txt")):
        assert f"benchmark_runs/{path.name}" in names, f"{path.name} is quoted by no page"
        command = path.read_text().splitlines()[0]
        assert command.startswith("$ "), f"{path.name} does not start with its command"
        scripts = [word for word in shlex.split(command[2:]) if word.startswith("benchmarks/")]
        assert scripts and (ROOT / scripts[0]).is_file(), f"{path.name}: {command}"
