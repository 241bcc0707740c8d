"""GGUF outputs, safety round 5: `--overwrite` replaces only GGUF files kha wrote (item 9: it replaced the downloaded
SmolLM2 asset itself), and a SIGKILLed export's hidden temporary file is removed by the next run (item 8: a 71 MB
`.kha-XXXX.gguf` stayed for good)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kha_hf.checkpoint.output import PARTIAL_FILE_PREFIX, remove_stale_partial_files
from kha_hf.cli import main
from tests.gguf.test_gguf_bad_input import fold_error, kha  # noqa: F401 (a fixture)

ROOT = Path(__file__).resolve().parents[2]


def test_overwrite_replaces_only_a_gguf_kha_wrote(kha, tmp_path, capsys):  # noqa: F811
    from kha_hf.common.assets import smollm2_gguf

    asset = tmp_path / "smollm2.gguf"  # a GGUF file kha did not write (a copy of the downloaded asset)
    asset.write_bytes(smollm2_gguf().read_bytes())
    before = asset.stat().st_size
    err = fold_error(capsys, kha, asset, "--overwrite")
    assert "is a GGUF file that kha did not write, or one that cannot be read" in err and "kha.written_by" in err
    assert asset.stat().st_size == before
    ours = tmp_path / "ours.gguf"
    assert main(["fold", str(kha), str(ours)]) == 0
    assert main(["fold", str(kha), str(ours), "--overwrite", "--outtype", "q8_0"]) == 0  # kha's own: replaced


def test_a_killed_exports_temporary_file_is_removed_by_the_next_run(kha, tmp_path):  # noqa: F811
    out = tmp_path / "m.gguf"
    code = (
        "import os, signal, sys\n"
        "from kha_hf.checkpoint.output import atomic_output_file\n"
        "with atomic_output_file(sys.argv[1]) as tmp:\n"
        "    tmp.write_bytes(b'GGUF' + bytes(1 << 20))\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    killed = subprocess.run(
        [sys.executable, "-c", code, str(out)], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    assert killed.returncode == -signal.SIGKILL
    left = [p for p in tmp_path.iterdir() if p.name.startswith(PARTIAL_FILE_PREFIX)]
    assert len(left) == 1 and left[0].suffix == ".gguf"
    assert remove_stale_partial_files(tmp_path, ".gguf") == []  # too fresh to tell from a run that just began
    old = time.time() - 120
    os.utime(left[0], (old, old))
    assert main(["fold", str(kha), str(out)]) == 0
    assert not left[0].exists() and out.is_file()


def test_a_running_exports_temporary_file_is_kept(tmp_path):
    from kha_hf.checkpoint.output import atomic_output_file

    with atomic_output_file(tmp_path / "m.gguf") as tmp:
        tmp.write_bytes(b"GGUF")
        old = time.time() - 120
        os.utime(tmp, (old, old))
        assert remove_stale_partial_files(tmp_path, ".gguf") == []  # locked by this run
        assert tmp.exists()


def test_a_users_file_that_merely_looks_like_a_partial_is_kept(kha, tmp_path):  # noqa: F811
    """The review's finding: `.kha-file-notes.gguf`, a user's own file two minutes old, was deleted by the next
    export; only names that tempfile makes (8 characters of [a-z0-9_]) are kha's."""
    notes = tmp_path / f"{PARTIAL_FILE_PREFIX}notes.gguf"
    notes.write_text("mine")
    old = time.time() - 120
    os.utime(notes, (old, old))
    assert main(["fold", str(kha), str(tmp_path / "m.gguf")]) == 0
    assert notes.read_text() == "mine"
    assert remove_stale_partial_files(tmp_path, "") == []  # no suffix: nothing is looked at
