"""README.md's Python snippets run as written (offline, in a fresh process, in an empty folder)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
SNIPPETS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_has_python_snippets():
    assert SNIPPETS


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_readme_snippet_runs(tmp_path, index):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home")}
    result = subprocess.run(
        [sys.executable, "-c", SNIPPETS[index]], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # knocks added to a base checkpoint start at the identity: no load report calls them "newly initialized"
    assert "LOAD REPORT" not in result.stderr and "newly initialized" not in result.stderr, result.stderr[-3000:]


def test_rerunning_a_snippet_names_the_python_keyword(tmp_path):
    """A second run of the API snippet finds its outputs there: the error names overwrite=True, not only the CLI's
    --overwrite."""
    snippet = next(s for s in SNIPPETS if "convert(" in s)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home")}
    run = [sys.executable, "-c", snippet]
    assert subprocess.run(run, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300).returncode == 0
    again = subprocess.run(run, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode != 0 and "overwrite=True" in again.stderr
