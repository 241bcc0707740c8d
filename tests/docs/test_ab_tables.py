"""The adapter A/B tables are the recorded runs' numbers: every row that benchmarks/ab_adapters_table.py prints from
docs/ab_adapters/*.json stands in docs/does-kha-help.md as printed, and every such row README.md quotes (its headline
verdict) is one of them (a rerun that changes a summary must change both pages)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUNS = {  # summary file -> the model and domain README names
    "smollm2_shakespeare.json": ("SmolLM2-135M", "Shakespeare"),
    "smollm2_code.json": ("SmolLM2-135M", "Python code"),
    "gemma3_shakespeare.json": ("Gemma 3 270M", "Shakespeare"),
    "gemma3_code.json": ("Gemma 3 270M", "Python code"),
}


def test_every_recorded_run_is_checked():
    assert {p.name for p in (ROOT / "docs" / "ab_adapters").glob("*.json")} <= set(RUNS)


@pytest.mark.parametrize("name", sorted(RUNS))
def test_readme_rows_are_the_summary(name):
    path = ROOT / "docs" / "ab_adapters" / name
    if not path.exists():
        pytest.skip(f"{name}: not run yet")
    model, domain = RUNS[name]
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "ab_adapters_table.py"), f"{model}:{domain}:{path}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = [line for line in out.splitlines() if line.startswith(f"| {model} | {domain} |")]
    assert len(rows) >= 7, out  # four arms, three comparisons
    page = (ROOT / "docs" / "does-kha-help.md").read_text()
    assert [row for row in rows if row not in page] == []
    quoted = [
        line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith(f"| {model} | {domain} |")
    ]
    assert quoted, f"README's headline verdict quotes no {model} {domain} row"
    assert [row for row in quoted if row not in rows] == []
