"""`kha train`, `kha ab` and `kha demo` write only where they may, and never leave a half-written model.

The real CLI (`kha_hf.cli.main`, or a subprocess where a signal must arrive mid-save) on the tiny Qwen3 KHA model of
conftest.py.
"""

import hashlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kha_hf.checkpoint.output import resumable_partials
from kha_hf.cli import main
from tests.cli.test_bad_input import one_line_error

TRAIN = ["--max-steps", "2", "--seq-len", "64", "--batch-size", "4", "--logging-steps", "1"]


def tree_digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def model_copy(kha_dir, tmp_path) -> Path:
    import shutil

    shutil.copytree(kha_dir, tmp_path / "model")
    return tmp_path / "model"


@pytest.mark.parametrize("where", ["model", "model_parent", "cwd", "home", "data", "inside_data", "earlier"])
def test_train_refuses_destinations_it_could_harm(model_copy, corpus, tmp_path, capsys, monkeypatch, where):
    data, _ = corpus
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "config.json").write_text("{}")
    output = {
        "model": model_copy,
        "model_parent": model_copy.parent,
        "cwd": Path("."),
        "home": tmp_path / "home",
        "data": data,
        "inside_data": data / "out",
        "earlier": earlier,
    }[where]
    before = {p: tree_digest(p) for p in (model_copy, data, earlier)}
    err = one_line_error(
        capsys, ["train", str(model_copy), "--output", str(output), "--data", str(data), *TRAIN], "train"
    )
    assert any(
        word in err
        for word in (
            "is the source",
            "contains the source",
            "current directory",
            "home",
            "inside the data folder",
            "already exists",
        )
    )
    assert {p: tree_digest(p) for p in before} == before
    assert not (data / "out").exists()


def test_a_small_corpus_trains_and_saves(kha_dir, tmp_path):
    """Fewer held-out blocks than the batch size: the eval batch shrinks, eval_loss exists, the model is saved."""
    small = tmp_path / "small.txt"
    small.write_text("To be, or not to be, that is the question. " * 120)  # ~5 kB: 1-2 held-out blocks
    out = tmp_path / "t"
    assert (
        main(
            [
                "train",
                str(kha_dir),
                "--output",
                str(out),
                "--data",
                str(small),
                "--max-steps",
                "1",
                "--seq-len",
                "32",
                "--batch-size",
                "8",
            ]
        )
        == 0
    )
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()


def test_overwrite_replaces_an_earlier_output_only_when_asked(kha_dir, corpus, tmp_path, capsys):
    data, _ = corpus
    out = tmp_path / "out"
    common = ["train", str(kha_dir), "--output", str(out), "--data", str(data), *TRAIN]
    assert main(common) == 0
    first = tree_digest(out)
    assert "already exists" in one_line_error(capsys, common, "train")
    assert tree_digest(out) == first
    assert main([*common, "--lr", "0.05", "--overwrite"]) == 0
    assert tree_digest(out)["model.safetensors"] != first["model.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".out.", ".kha-"))]


def test_sigterm_during_the_save_leaves_the_previous_model_intact(kha_dir, corpus, tmp_path):
    data, _ = corpus
    out = tmp_path / "out"
    assert main(["train", str(kha_dir), "--output", str(out), "--data", str(data), *TRAIN]) == 0
    before = tree_digest(out)
    script = textwrap.dedent(
        f"""
        import os, signal
        import kha_hf.modeling.modeling_kha as m
        from kha_hf.cli import main
        original = m.KHAPreTrainedModel.save_pretrained
        def save_then_die(self, folder, *args, **kwargs):
            result = original(self, folder, *args, **kwargs)
            if "checkpoint-" not in str(folder):
                os.kill(os.getpid(), signal.SIGTERM)  # the new weights are written, nothing is in place yet
            return result
        m.KHAPreTrainedModel.save_pretrained = save_then_die
        raise SystemExit(main(["train", {str(kha_dir)!r}, "--output", {str(out)!r}, "--data", {str(data)!r},
                               "--overwrite", "--lr", "0.05", *{TRAIN!r}]))
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert result.returncode == 130, result.stderr[-2000:]
    assert tree_digest(out) == before, "the previous model changed"
    from kha_hf import KHAForCausalLM

    KHAForCausalLM.from_pretrained(out)  # loads: nothing missing


def test_an_interrupted_run_is_kept_and_resumed(kha_dir, corpus, tmp_path):
    data, _ = corpus
    out = tmp_path / "out"
    script = textwrap.dedent(
        f"""
        import os, signal
        from transformers import TrainerCallback
        import kha_hf.training.train as t
        from kha_hf.cli import main
        class Die(TrainerCallback):
            def on_save(self, args, state, control, **kwargs):
                os.kill(os.getpid(), signal.SIGTERM)  # right after checkpoint-2 is written
        original = t.KHATrainer.__init__
        def init(self, *a, **k):
            original(self, *a, **k)
            self.add_callback(Die)
        t.KHATrainer.__init__ = init
        raise SystemExit(main(["train", {str(kha_dir)!r}, "--output", {str(out)!r}, "--data", {str(data)!r},
                               "--max-steps", "4", "--save-steps", "2", "--seq-len", "64", "--batch-size", "4"]))
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert result.returncode == 130, result.stderr[-2000:]
    assert not out.exists()
    kept = resumable_partials(out)
    assert len(kept) == 1 and (kept[0] / "checkpoint-2" / "trainer_state.json").is_file()
    assert "--resume" in result.stdout
    assert (
        main(
            [
                "train",
                str(kha_dir),
                "--output",
                str(out),
                "--data",
                str(data),
                "--max-steps",
                "4",
                "--save-steps",
                "2",
                "--seq-len",
                "64",
                "--batch-size",
                "4",
                "--resume",
            ]
        )
        == 0
    )
    state = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["global_step"] == 4 and (out / "config.json").is_file()
    assert not resumable_partials(out) and not kept[0].exists()


def test_resume_with_nothing_to_resume_is_one_line(kha_dir, tmp_path, capsys):
    err = one_line_error(capsys, ["train", str(kha_dir), "--output", str(tmp_path / "o"), "--resume"], "train")
    assert "nothing to resume" in err


def test_ab_from_refuses_an_existing_output_and_keeps_its_files(kha_dir, tmp_path, capsys):
    out = tmp_path / "ab"
    (out / "kha").mkdir(parents=True)
    (out / "kha" / "mine.txt").write_text("a user's file")
    err = one_line_error(capsys, ["ab", "--from", str(kha_dir), "--output", str(out)], "ab")
    assert "already exists" in err
    err = one_line_error(capsys, ["ab", "--from", str(kha_dir), "--output", str(out), "--overwrite"], "ab")
    assert "does not look like a folder kha wrote" in err
    assert (out / "kha" / "mine.txt").read_text() == "a user's file"


@pytest.mark.parametrize("command", [["demo"], ["ab"]])
def test_demo_and_ab_refuse_protected_destinations(tmp_path, capsys, monkeypatch, command):
    monkeypatch.chdir(tmp_path)
    err = one_line_error(capsys, [*command, "--output", "."], command[0])
    assert "current directory" in err


def test_a_tokenizer_past_the_models_vocabulary_is_one_line(model_copy, corpus, tmp_path, capsys):
    """A --tokenizer whose ids reach past the model's embedding (the tiny model has 512 rows) was an IndexError deep
    in the first forward; it is refused in one line, before anything trains or is written."""
    from kha_hf.training.data import read_documents
    from kha_hf.training.tokenizer import train_bpe_tokenizer

    data, _ = corpus
    big = tmp_path / "big-tokenizer"
    train_bpe_tokenizer(read_documents([str(data)]), vocab_size=2048).save_pretrained(big)
    output = tmp_path / "out"
    err = one_line_error(
        capsys,
        ["train", str(model_copy), "--output", str(output), "--data", str(data), "--tokenizer", str(big), *TRAIN],
        "train",
    )
    assert "past the model's vocabulary of 512" in err and "--tokenizer" in err
    assert not output.exists()
