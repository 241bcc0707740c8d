"""Issue #28, destinations and writes, for `kha train` (round 4): `--resume` passes the destination rule of a plain
run, adopts only a real folder with kha's marker, a SIGTERM after the swap is a success, a SIGKILLed run is
resumable and never deleted by the next plain run, and `--overwrite` replaces only what kha wrote.

The real CLI (a subprocess where a signal must arrive at one exact point) on the tiny Qwen3 KHA model of conftest.py.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

from kha_hf import __version__
from kha_hf.checkpoint.output import PARTIAL_MARKER, resumable_partials
from kha_hf.checkpoint.paths import OUTPUT_MARKER
from kha_hf.cli import main
from tests.cli.test_bad_input import one_line_error
from tests.helpers import run_at_work_in
from tests.training.test_train_safety import TRAIN, tree_digest

RUN = ["--max-steps", "4", "--save-steps", "2", "--seq-len", "64", "--batch-size", "4"]


def fake_run(folder: Path) -> Path:
    """A folder that looks like a training run (checkpoint-2/trainer_state.json)."""
    (folder / "checkpoint-2").mkdir(parents=True)
    (folder / "checkpoint-2" / "trainer_state.json").write_text('{"global_step": 2}')
    return folder


def leftovers(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if p.name.startswith(".kha-") or p.name.endswith(".partial")]


# High 4: --resume follows the destination rule --------------------------------------------------------------------
def test_resume_into_the_current_directory_is_refused(kha_dir, tmp_path, capsys, monkeypatch):
    proj = fake_run(tmp_path / "proj")
    (proj / "important.txt").write_text("keep me")
    (proj / "data").mkdir()
    (proj / "data" / "corpus.txt").write_text("To be, or not to be. " * 500)
    (proj / OUTPUT_MARKER).write_text("{}")  # even a folder kha wrote: never the working directory
    before = tree_digest(proj)
    monkeypatch.chdir(proj)
    argv = ["train", str(kha_dir), "--output", ".", "--resume", "--data", "data/corpus.txt", *TRAIN]
    err = one_line_error(capsys, argv, "train")
    assert "current directory" in err
    assert tree_digest(proj) == before


def test_resume_into_the_source_is_refused(kha_dir, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(kha_dir, model)
    fake_run(model)
    (model / "notes.txt").write_text("keep me")
    before = tree_digest(model)
    err = one_line_error(capsys, ["train", str(model), "--output", str(model), "--resume", *TRAIN], "train")
    assert "is the source" in err
    assert tree_digest(model) == before


def test_resume_into_a_folder_holding_the_data_is_refused(kha_dir, corpus, tmp_path, capsys):
    out = fake_run(tmp_path / "out")
    (out / OUTPUT_MARKER).write_text("{}")
    shutil.copytree(corpus[0], out / "data")
    before = tree_digest(out)
    argv = ["train", str(kha_dir), "--output", str(out), "--resume", "--data", str(out / "data"), *TRAIN]
    err = one_line_error(capsys, argv, "train")
    assert "contains the source" in err
    assert tree_digest(out) == before


def test_resume_replaces_only_a_folder_kha_wrote(kha_dir, tmp_path, capsys):
    out = fake_run(tmp_path / "out")  # checkpoints, but no marker: not ours to replace
    (out / "notes.txt").write_text("keep me")
    before = tree_digest(out)
    err = one_line_error(capsys, ["train", str(kha_dir), "--output", str(out), "--resume", *TRAIN], "train")
    assert "does not look like a folder kha wrote" in err
    assert tree_digest(out) == before


def test_resume_refuses_an_output_that_is_a_link(kha_dir, tmp_path, capsys):
    real = fake_run(tmp_path / "real")
    (real / OUTPUT_MARKER).write_text("{}")
    (tmp_path / "out").symlink_to(real)
    err = one_line_error(capsys, ["train", str(kha_dir), "--output", str(tmp_path / "out"), "--resume"], "train")
    assert "not a folder" in err
    assert (tmp_path / "out").is_symlink() and (real / "checkpoint-2").is_dir()


# Medium 7: no partial that is a symbolic link is adopted -------------------------------------------------------
def test_resume_never_adopts_a_linked_partial(kha_dir, tmp_path, capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    target = fake_run(tmp_path / "elsewhere")
    record = {"destination": "out", "host": socket.gethostname(), "pid": dead.pid, "state": "resumable"}
    (target / PARTIAL_MARKER).write_text(json.dumps(record))
    (target / "precious.txt").write_text("keep")
    (tmp_path / ".kha-abcd1234.partial").symlink_to(target)
    before = tree_digest(target)
    err = one_line_error(capsys, ["train", str(kha_dir), "--output", str(tmp_path / "out"), "--resume"], "train")
    assert "nothing to resume" in err
    assert tree_digest(target) == before and not (tmp_path / "out").exists()


# Medium 5: --overwrite of a folder that only looks like a model ---------------------------------------------------
def test_train_overwrite_refuses_a_checkpoint_kha_did_not_write(kha_dir, corpus, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text('{"name": "app"}')
    (out / "main.py").write_text("print(1)\n")
    before = tree_digest(out)
    argv = ["train", str(kha_dir), "--output", str(out), "--data", str(corpus[0]), "--overwrite", *TRAIN]
    err = one_line_error(capsys, argv, "train")
    assert "does not look like a folder kha wrote" in err
    assert tree_digest(out) == before


def test_train_refuses_a_model_folder_linking_out(kha_dir, corpus, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(kha_dir, model)
    (tmp_path / "secret.txt").write_text("---\nlicense: mit\n---\nthe password is hunter2\n")
    (model / "README.md").unlink(missing_ok=True)
    (model / "README.md").symlink_to(tmp_path / "secret.txt")
    argv = ["train", str(model), "--output", str(tmp_path / "out"), "--data", str(corpus[0]), *TRAIN]
    err = one_line_error(capsys, argv, "train")
    assert "README.md" in err and "outside the source" in err
    assert not (tmp_path / "out").exists()


# Medium 8: SIGTERM after the swap, SIGKILL -------------------------------------------------------------------------
def _run_script(kha_dir, data, out, extra: list[str], prelude: str) -> subprocess.CompletedProcess:
    script = textwrap.dedent(prelude) + textwrap.dedent(
        f"""
        from kha_hf.cli import main
        raise SystemExit(main(["train", {str(kha_dir)!r}, "--output", {str(out)!r}, "--data", {str(data)!r},
                               *{extra!r}]))
        """
    )
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)


def test_sigterm_just_after_the_swap_is_a_success_and_leaves_nothing_resumable(kha_dir, corpus, tmp_path):
    data, _ = corpus
    out = tmp_path / "out"
    assert main(["train", str(kha_dir), "--output", str(out), "--data", str(data), *TRAIN]) == 0
    assert json.loads((out / OUTPUT_MARKER).read_text()) == {"command": "kha train", "version": __version__}
    first = tree_digest(out)
    prelude = """
        import os, signal
        import kha_hf.checkpoint.output as o
        original = o.exchange
        def exchange_then_die(a, b):
            original(a, b)
            os.kill(os.getpid(), signal.SIGTERM)  # the new model is in place, the old run not yet removed
        o.exchange = exchange_then_die
        """
    result = _run_script(kha_dir, data, out, ["--overwrite", "--lr", "0.05", *TRAIN], prelude)
    assert result.returncode == 0, result.stderr[-2000:]
    assert tree_digest(out)["model.safetensors"] != first["model.safetensors"]
    assert not (out / PARTIAL_MARKER).exists()
    assert resumable_partials(out) == [] and leftovers(tmp_path) == []


def test_a_sigkilled_run_is_resumable_and_never_deleted(kha_dir, corpus, tmp_path, capsys):
    data, _ = corpus
    out = tmp_path / "out"
    prelude = """
        import os, signal
        from transformers import TrainerCallback
        import kha_hf.training.train as t
        class Die(TrainerCallback):
            def on_save(self, args, state, control, **kwargs):
                os.kill(os.getpid(), signal.SIGKILL)  # the OOM killer, right after checkpoint-2 is written
        original = t.KHATrainer.__init__
        def init(self, *a, **k):
            original(self, *a, **k)
            self.add_callback(Die)
        t.KHATrainer.__init__ = init
        """
    result = _run_script(kha_dir, data, out, RUN, prelude)
    assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]
    assert not out.exists()
    kept = resumable_partials(out)
    assert len(kept) == 1 and (kept[0] / "checkpoint-2" / "trainer_state.json").is_file()
    saved = tree_digest(kept[0] / "checkpoint-2")
    # a plain run neither deletes the checkpoints nor starts beside them: it says what to do
    err = one_line_error(capsys, ["train", str(kha_dir), "--output", str(out), "--data", str(data), *RUN], "train")
    assert "--resume" in err and str(kept[0]) in err
    assert tree_digest(kept[0] / "checkpoint-2") == saved
    assert main(["train", str(kha_dir), "--output", str(out), "--data", str(data), *RUN, "--resume"]) == 0
    state = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["global_step"] == 4 and (out / "config.json").is_file() and (out / OUTPUT_MARKER).is_file()
    assert not (out / PARTIAL_MARKER).exists()
    assert resumable_partials(out) == [] and leftovers(tmp_path) == []


def test_a_partial_whose_process_still_runs_is_not_adopted(kha_dir, tmp_path, capsys):
    folder = fake_run(tmp_path / ".kha-live1234.partial")
    record = {"destination": "out", "host": socket.gethostname(), "pid": os.getpid(), "state": "resumable"}
    (folder / PARTIAL_MARKER).write_text(json.dumps(record))
    with run_at_work_in(folder):
        err = one_line_error(capsys, ["train", str(kha_dir), "--output", str(tmp_path / "out"), "--resume"], "train")
    assert "nothing to resume" in err and folder.is_dir()
