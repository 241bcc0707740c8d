"""Every bad argument is one line, `kha <command>: error: ...`, exit 2, no traceback, before any heavy work."""

import json
import shutil
from pathlib import Path

import pytest

import kha_hf.checkpoint.output as output
from kha_hf.cli import main
from tests.conversion.test_convert import make_checkpoint
from tests.helpers import run_python, tiny_base_model


def one_line_error(capsys, argv, command: str) -> str:
    capsys.readouterr()
    try:
        rc = main(argv)
    except SystemExit as exit_:  # argparse
        rc = exit_.code
    err = capsys.readouterr().err.strip()
    assert rc == 2, f"exit {rc}: {err}"
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"kha {command}: error: "), err
    return err


@pytest.fixture
def llama(tmp_path) -> Path:
    folder = tmp_path / "llama"
    make_checkpoint(folder)
    return folder


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: [1, 2], "JSON object"),
        (lambda c: {**c, "hidden_size": "64"}, "hidden_size must be a positive integer"),
        (lambda c: {**c, "num_attention_heads": 0}, "num_attention_heads must be a positive integer"),
    ],
)
def test_invalid_config_json(llama, tmp_path, capsys, edit, message):
    config = json.loads((llama / "config.json").read_text())
    (llama / "config.json").write_text(json.dumps(edit(config)))
    assert message in one_line_error(capsys, ["convert", str(llama), str(tmp_path / "out")], "convert")


def test_train_refuses_an_unsupported_model_without_building_a_default_one(tmp_path, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(tmp_path / "gpt2")
    err = one_line_error(capsys, ["train", str(tmp_path / "gpt2"), "--output", str(tmp_path / "o")], "train")
    assert "'gpt2' model" in err and "llama" in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "args",
    [
        ["--max-steps", "0"],
        ["--max-steps", "-3"],
        ["--seq-len", "0"],
        ["--batch-size", "-1"],
        ["--lr", "-1e-3"],
        ["--knock-lr", "nan"],
        ["--grad-accum", "0"],
    ],
)
def test_train_numbers(llama, tmp_path, capsys, args):
    err = one_line_error(capsys, ["train", str(llama), "--output", str(tmp_path / "o"), *args], "train")
    assert args[0] in err


@pytest.mark.parametrize("layers", [",", "3-1", "", "a-b"])
def test_knock_layers_that_select_nothing(llama, tmp_path, capsys, layers):
    err = one_line_error(capsys, ["convert", str(llama), str(tmp_path / "o"), "--knock-layers", layers], "convert")
    assert "--knock-layers" in err


@pytest.mark.parametrize("limit", ["0", "-5"])
def test_eval_limit(llama, capsys, limit):
    one_line_error(capsys, ["eval", "--candidate", str(llama), "--limit", limit], "eval")


def test_eval_perplexity_file_missing_or_binary(llama, tmp_path, capsys):
    (tmp_path / "blob.txt").write_bytes(b"\x00\x01\x02binary")
    for name, message in (("missing.txt", "no such file"), ("blob.txt", "binary")):
        argv = ["eval", "--candidate", str(llama), "--tasks", "arc_easy", "--perplexity", str(tmp_path / name)]
        assert message in one_line_error(capsys, argv, "eval")


def test_training_data_binary_or_non_string_text(llama, tmp_path, capsys):
    (tmp_path / "bin.txt").write_bytes(b"\x00\xff\x00")
    (tmp_path / "rows.jsonl").write_text('{"text": 5}\n')
    for name, message in (("bin.txt", "binary"), ("rows.jsonl", "must be a string")):
        argv = ["train", str(llama), "--output", str(tmp_path / "o"), "--data", str(tmp_path / name)]
        assert message in one_line_error(capsys, argv, "train")


@pytest.mark.parametrize("device", ["cuda:7", "banana", "mps"])
def test_devices_that_do_not_exist(llama, tmp_path, capsys, device):
    import torch

    if device.startswith("cuda") and torch.cuda.device_count() > 7:
        pytest.skip("this machine has that device")
    if device == "mps" and torch.backends.mps.is_available():
        pytest.skip("this machine has that device")
    err = one_line_error(capsys, ["verify", str(llama), str(llama), "--device", device], "verify")
    assert device in err
    err = one_line_error(capsys, ["eval", "--candidate", str(llama), "--device", device], "eval")
    assert device in err


def test_checkpoint_without_tokenizer_names_the_tokenizer_option(tmp_path, capsys):
    from kha_hf import KHAForCausalLM

    KHAForCausalLM.from_base(tiny_base_model("llama")).save_pretrained(tmp_path / "kha")
    err = one_line_error(capsys, ["train", str(tmp_path / "kha"), "--output", str(tmp_path / "o")], "train")
    assert "--tokenizer" in err
    err = one_line_error(capsys, ["verify", str(tmp_path / "kha"), str(tmp_path / "kha")], "verify")
    assert "--tokenizer" in err


def test_full_destination_reports_both_sizes(llama, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(output.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - 4096, 4096))
    err = one_line_error(capsys, ["convert", str(llama), str(tmp_path / "o")], "convert")
    assert "not enough free space" in err and "MiB available" in err and "needs" in err
    assert not (tmp_path / "o").exists()


def test_unwritable_destination(llama, tmp_path, capsys, monkeypatch):
    import tempfile

    def read_only(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkdtemp", read_only)
    err = one_line_error(capsys, ["convert", str(llama), str(tmp_path / "o")], "convert")
    assert "Permission denied" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["convert", "{tmp}/nope", "{tmp}/out"],
        ["convert", "{tmp}/nope/model", "{tmp}/out"],
        ["verify", "{tmp}/nope", "{tmp}/nope2"],
        ["eval", "--candidate", "{tmp}/nope"],
        ["train", "{tmp}/nope", "--output", "{tmp}/o"],
    ],
)
def test_missing_local_paths_are_reported_as_missing(tmp_path, capsys, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    argv = [a.format(tmp=tmp_path) for a in argv]
    err = one_line_error(capsys, argv, argv[0])
    assert "no such file or folder" in err and "Hub" not in err.split("(")[0]


def test_missing_relative_path_under_an_existing_folder_is_not_a_hub_id(llama, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    err = one_line_error(capsys, ["convert", "models/llama", "out"], "convert")
    assert "no such file or folder" in err
    (tmp_path / "data").mkdir()
    err = one_line_error(capsys, ["train", str(llama), "--output", "o", "--data", "data/corpus"], "train")
    assert "no such file or folder" in err


def test_unreachable_hub_says_offline_and_how(tmp_path):
    # a real connection failure (nothing listens on port 9), not a mocked exception: the hint must survive
    # huggingface_hub wrapping the httpx ConnectError in LocalEntryNotFoundError
    argv = ["convert", "someone/some-model", str(tmp_path / "out")]
    script = f"import sys\nfrom kha_hf.cli import main\nsys.exit(main({argv!r}))"
    done = run_python(
        script, tmp_path, without_kha_hf=False, env={"HF_HUB_OFFLINE": None, "HF_ENDPOINT": "http://127.0.0.1:9"}
    )
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(err) == 1, done.stderr
    assert "cannot fetch 'someone/some-model'" in err[0] and "offline? set HF_HUB_OFFLINE=1" in err[0], err[0]
    assert not (tmp_path / "out").exists()
