"""The evidence pages hold the recorded runs' numbers and nothing else: each table of docs/does-kha-help.md's A/B
sections is exactly what benchmarks/ab_tables.py prints from the summary.json files kept under docs/ab_runs/ and
docs/ab_adapters/, the demo's section is what `kha demo` renders from its kept summary, and every row README.md
quotes (its headline verdict) is one of them. A rerun that changes a summary must change the pages with it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "does-kha-help.md"
# kind of run -> (the page's section, the summaries with the model and domain its tables name)
RUNS = {
    "scratch": ("## From scratch", [("ab_runs/scratch_cpu_tiny.json", None)]),
    "continued": (
        "## Continued training from a real checkpoint",
        [("ab_runs/continued_smollm2.json", ("SmolLM2-135M", "Shakespeare"))],
    ),
    "adapters": (
        "## The knock adapter against LoRA, IA3 and OFT",
        [
            ("ab_adapters/smollm2_shakespeare.json", ("SmolLM2-135M", "Shakespeare")),
            ("ab_adapters/smollm2_code.json", ("SmolLM2-135M", "Python code")),
            ("ab_adapters/gemma3_shakespeare.json", ("Gemma 3 270M", "Shakespeare")),
            ("ab_adapters/gemma3_code.json", ("Gemma 3 270M", "Python code")),
        ],
    ),
}
DEMO = ("## The demo", "ab_runs/demo_smollm2.json")
# "Reproduce the paper": the CPU ablation (`kha ab cpu-tiny-moe --variants ...`) and the GPU-hours estimate per preset
REPRODUCE = ROOT / "docs" / "guides" / "reproduce-paper.md"
ABLATION = "ab_runs/ablation_cpu_tiny_moe.json"


def section(heading: str, page: Path = PAGE) -> list[str]:
    """The lines of PAGE's section HEADING, up to the next `## ` heading."""
    lines = page.read_text().splitlines()
    start = lines.index(heading)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start + 1 : end]


def tables(lines: list[str]) -> list[tuple[str, ...]]:
    """The tables in LINES, each a run of lines that start with `|` (indented ones too: markdown still draws them)."""
    found, current = [], []
    for line in [*lines, ""]:
        if line.lstrip().startswith("|"):
            current.append(line)
        elif current:
            found.append(tuple(current))
            current = []
    return found


def printed(kind: str) -> list[str]:
    """What benchmarks/ab_tables.py prints for every recorded run of KIND (one call, as the page's tables are)."""
    args = [
        str(ROOT / "docs" / path) if names is None else f"{names[0]}:{names[1]}:{ROOT / 'docs' / path}"
        for path, names in RUNS[kind][1]
    ]
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "ab_tables.py"), kind, *args],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()


def test_every_recorded_run_is_checked():
    kept = {
        f"{p.parent.name}/{p.name}"
        for folder in ("ab_runs", "ab_adapters")
        for p in (ROOT / "docs" / folder).glob("*.json")
    }
    named = {path for _, runs in RUNS.values() for path, _ in runs} | {DEMO[1], ABLATION}
    assert kept == named  # a summary nobody checks, or a checked one that is missing


@pytest.mark.parametrize("kind", sorted(RUNS))
def test_each_table_is_the_summaries(kind):
    expected = tables(printed(kind))
    assert expected and all(len(table) >= 3 for table in expected), expected
    # the section's tables are exactly the printed ones, each whole and in order (and none of the page's own)
    assert sorted(tables(section(RUNS[kind][0]))) == sorted(expected)


def test_readme_quotes_only_recorded_rows():
    rows = printed("adapters")
    quoted = tables(section("## Does KHA help?", ROOT / "README.md"))
    assert quoted, "README's headline verdict quotes no recorded row"
    assert [row for table in quoted for row in table if row not in rows] == []


def test_the_demo_section_is_the_demo_summary():
    from kha_hf.workflows.demo import demo_table

    s = json.loads((ROOT / "docs" / DEMO[1]).read_text())
    p = s["parameters"]
    table = demo_table(
        s["rows"], s["heldout_loss"], p, p["lora_rank"], p["lora_targets"], s["train_steps"], s["limit"], s["lr"]
    )
    rendered = table.splitlines()
    page = section(DEMO[0])
    assert [line for line in rendered if line and not line.startswith("|") and line not in page] == []  # the prose
    assert sorted(tables(page)) == sorted(tables(rendered))


@pytest.mark.parametrize(
    ("kind", "args", "heading"),
    [("ablation", [ABLATION], "## What ran here"), ("costs", [], "## What it would cost on a GPU")],
)
def test_the_reproduce_page_holds_the_ablation_and_the_costs_as_printed(kind, args, heading):
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "ab_tables.py"), kind, *(str(ROOT / "docs" / a) for a in args)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    expected = tables(out)
    assert expected and all(len(table) >= 3 for table in expected), out
    assert sorted(tables(section(heading, REPRODUCE))) == sorted(expected)


def test_the_ablation_summary_is_the_papers_rows_on_three_seeds():
    summary = json.loads((ROOT / "docs" / ABLATION).read_text())
    assert summary["seeds"] == [0, 1, 2] and summary["base_model_type"] == "qwen3_moe"
    assert {"mlp_v", "linear_v", "mlp_qkv", "gate_v", "mlp_v_random"} <= set(summary["variants"])
    for entry in summary["variants"].values():
        assert entry["ci95"] is not None and len(entry["per_seed"]) == 3
