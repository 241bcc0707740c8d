"""Write failures under a file-size limit (safety round 5, item 13): the one-line error names the file being
written, not the source shard (kha convert) or numpy's "N requested and M written" alone (the GGUF export), and
nothing is left behind."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

from tests.gguf.conftest import tiny_kha
from tests.helpers import save_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 200_000  # bytes: the tiny models' shards are about 6 MB


def kha_limited(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, LIMIT))

    return subprocess.run(
        [sys.executable, "-m", "kha_hf_entry", *argv],
        preexec_fn=limit,
        capture_output=True,
        text=True,
        cwd=cwd,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"},
        timeout=300,
    )


def test_convert_names_the_shard_it_was_writing(tmp_path):
    save_tiny_checkpoint(tmp_path / "base", "llama", hidden_size=256, intermediate_size=512)
    run = kha_limited(["convert", "base", "out"], tmp_path)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1:] == [  # after the progress bar
        "kha convert: error: File too large (a file-size limit of this process: ulimit -f): writing "
        "model-00001-of-00001.safetensors; nothing was written"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base"]


def test_the_gguf_export_says_what_a_short_write_means(tmp_path):
    tiny_kha(tmp_path / "kha", "llama", hidden_size=256, intermediate_size=512)
    run = kha_limited(["fold", "kha", "out.gguf"], tmp_path)
    assert run.returncode == 2
    line = run.stderr.strip().splitlines()[-1]
    assert line.startswith("kha fold: error: cannot write out.gguf: only part of a write reached the file (")
    assert line.endswith("the disk is full or a file-size limit (ulimit -f) is set; nothing was written")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kha"]
