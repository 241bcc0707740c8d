"""`axolotl kha-convert` and `axolotl kha-fold` (kha-hf's `axolotl.cli_commands` entry points): kha's own commands
from Axolotl's console script, arguments and errors as kha's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def _axolotl(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    axolotl = Path(sys.executable).parent / "axolotl"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "AXOLOTL_DO_NOT_TRACK": "1", "HF_HOME": str(cwd / "hf_home")}
    return subprocess.run(
        [str(axolotl), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL
    )


def test_axolotl_kha_convert_and_kha_fold(tmp_path):
    from tests.helpers import save_tiny_checkpoint

    save_tiny_checkpoint(tmp_path / "base", "llama")
    done = _axolotl("kha-convert", "base", "kha", "--knock", "linear_v", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "kha" / "config.json").read_text())["model_type"] == "kha"
    folded = _axolotl("kha-fold", "kha", "folded", cwd=tmp_path)
    assert folded.returncode == 0, folded.stderr[-3000:]
    assert json.loads((tmp_path / "folded" / "config.json").read_text())["model_type"] == "llama"


def test_a_bad_argument_is_kha_s_one_line_error(tmp_path):
    done = _axolotl("kha-fold", "missing", "out", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == "kha fold: error: No such file or directory: missing"
