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
