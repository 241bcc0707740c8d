"""The code blocks of README.md and docs/: every Python block runs as written (offline, in a fresh process, in an
empty folder), every shell block marked `<!-- run -->` runs, and every other shell or Python block says why it is
not run here (`<!-- not-run: REASON -->`). An unmarked shell block fails, naming its file and line."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs.blocks import ROOT, all_blocks

BLOCKS = all_blocks()
CODE = [b for b in BLOCKS if b.kind]
PYTHON_RUN = [b for b in CODE if b.kind == "python" and b.marker is None]
SHELL_RUN = [b for b in CODE if b.kind == "shell" and b.marker == "run"]
README = ROOT / "README.md"


def offline_env(tmp_path: Path) -> dict:
    bin_dir = str(Path(sys.executable).parent)  # `kha` of this environment first
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf_home"),
        "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
    }


def test_the_docs_have_runnable_python():
    assert any(b.path == README for b in PYTHON_RUN), "README's ten-line Python example must run"
    assert len(PYTHON_RUN) >= 5


def test_every_shell_and_python_block_is_run_or_says_why_not():
    unmarked = [b.where for b in CODE if b.kind == "shell" and b.marker is None]
    assert unmarked == [], f"shell blocks neither run (<!-- run -->) nor marked <!-- not-run: REASON -->: {unmarked}"
    no_reason = [b.where for b in CODE if b.marker == "not-run" and len(b.reason) < 10]
    assert no_reason == [], f"<!-- not-run --> without a reason: {no_reason}"
    stray = [b.where for b in BLOCKS if b.marker and not b.kind]
    assert stray == [], f"run markers on blocks that are neither shell nor Python: {stray}"


def run_block(tmp_path: Path, command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=tmp_path, env=offline_env(tmp_path), capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("block", PYTHON_RUN, ids=[b.where for b in PYTHON_RUN])
def test_python_block_runs(tmp_path, block):
    result = run_block(tmp_path, [sys.executable, "-c", block.code])
    assert result.returncode == 0, f"{block.where}\n{result.stderr[-3000:]}"
    # knocks added to a base checkpoint start at the identity: no load report calls them "newly initialized"
    assert "LOAD REPORT" not in result.stderr and "newly initialized" not in result.stderr, result.stderr[-3000:]


@pytest.mark.parametrize("block", SHELL_RUN, ids=[b.where for b in SHELL_RUN])
def test_shell_block_runs(tmp_path, block):
    result = run_block(tmp_path, ["bash", "-euo", "pipefail", "-c", block.code])
    assert result.returncode == 0, f"{block.where}\n{result.stdout[-1500:]}\n{result.stderr[-3000:]}"


def test_rerunning_a_snippet_names_the_python_keyword(tmp_path):
    """A second run of the API snippet finds its outputs there: the error names overwrite=True, not only the CLI's
    --overwrite."""
    snippet = next(b.code for b in PYTHON_RUN if "convert(" in b.code)
    assert run_block(tmp_path, [sys.executable, "-c", snippet]).returncode == 0
    again = run_block(tmp_path, [sys.executable, "-c", snippet])
    assert again.returncode != 0 and "overwrite=True" in again.stderr


# --- README: short, its commands true, its links alive


def test_readme_is_short():
    assert len(README.read_text().splitlines()) <= 200


def test_readme_command_two_is_what_ci_runs():
    """.ci/run runs README's test command as written (the not-run marker of the two commands says so)."""
    two = [line for line in README.read_text().splitlines() if line.startswith("bash scripts/install.sh test && ")]
    assert len(two) == 1
    command = two[0].split("  #")[0].strip()
    install, tests = (part.strip() for part in command.split(" && "))
    ci = (ROOT / ".ci" / "run").read_text()
    # CI installs the test environment beside the side environments (at once), then runs the command's tests
    assert install == "bash scripts/install.sh test" and '"bash scripts/install.sh test"' in ci
    assert f'phase "main suite" {tests}\n' in ci


def _slug(heading: str) -> str:
    pytest.importorskip("markdown", reason="the docs extra (pip install -e '.[docs]') is not installed")
    from markdown.extensions.toc import slugify  # what mkdocs' toc uses for anchors

    return slugify(heading, "-")


def test_readme_links_point_at_files_and_headings_that_exist():
    text = README.read_text()
    broken = []
    for number, line in enumerate(text.splitlines(), 1):
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = ROOT / path if path else README
            if not file.exists():
                broken.append(f"README.md:{number}: {target}")
            elif anchor and file.suffix == ".md":
                headings = re.findall(r"^#{1,6} (.+)$", file.read_text(), re.M)
                if anchor not in {_slug(h) for h in headings}:
                    broken.append(f"README.md:{number}: {target} (no such heading)")
    assert broken == []


def test_readme_cli_flags_exist():
    """The docs build checks every page's `kha COMMAND --flag`; README is not a page of the site, so it is checked
    here with the same function."""
    pytest.importorskip("mkdocs", reason="the docs extra (pip install -e '.[docs]') is not installed")
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import hooks
    finally:
        sys.path.remove(str(ROOT / "docs"))
    stale = [f"README.md:{n}: {cmd} {flag}" for n, cmd, flag in hooks.stale_flags(README.read_text())]
    assert stale == []
