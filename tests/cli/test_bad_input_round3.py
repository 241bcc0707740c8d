"""Safety round 3 (issue 20): hostile configs, knocks, plots, serve arguments and request fields end in one line.

Each case runs the real `kha` command (`kha_hf.cli.main`) on tiny checkpoints and asserts the one-line error, exit 2
and, where files are involved, that nothing was written or lost.
"""

import json
import os
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kha_hf import KHAForCausalLM
from kha_hf.cli import main
from kha_hf.conversion import convert
from tests.cli.test_bad_input import one_line_error
from tests.conversion.test_convert import make_checkpoint
from tests.helpers import save_tiny_checkpoint, save_tiny_tokenizer, tiny_base_model

KNOCKS = "model-kha-knocks.safetensors"


@pytest.fixture
def llama(tmp_path) -> Path:
    folder = tmp_path / "llama"
    make_checkpoint(folder, sharded=False)
    save_tiny_tokenizer(folder)
    return folder


@pytest.fixture
def linear_kha(llama, tmp_path) -> Path:
    return convert(llama, tmp_path / "kha", knock="linear_qkv", progress=False).output


def edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def edit_knocks(folder: Path, edit) -> None:
    knocks = load_file(folder / KNOCKS)
    edit(knocks)
    save_file(knocks, folder / KNOCKS, metadata={"format": "pt"})
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != KNOCKS or k in knocks}
    index["weight_map"].update(dict.fromkeys(knocks, KNOCKS))
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


# --- kha verify / eval / train on config values that contradict the weights ---------------------------------------
@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"head_dim": 0}, "head_dim must be a positive integer"),
        ({"head_dim": -16}, "head_dim must be a positive integer"),
        ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer"),
        ({"vocab_size": -1}, "vocab_size must be a positive integer"),
        ({"vocab_size": 129}, "vocab_size 129, the embedding has 128 rows"),
        ({"dtype": "float128"}, "not a torch floating-point dtype"),
        ({"num_hidden_layers": 10**9}, "num_hidden_layers 1000000000 is beyond any model's (4096 at most)"),
        ({"num_hidden_layers": 4}, "says 4 layers, the weights hold 3"),
        ({"num_hidden_layers": 2}, "says 2 layers, the weights hold 3"),
        ({"hidden_size": 32}, "hidden_size 32, the embedding is 64 wide"),
    ],
)
def test_config_values_are_checked_against_the_weights_before_loading(llama, tmp_path, capsys, changes, message):
    kha = convert(llama, tmp_path / "kha", progress=False).output
    edit_config(kha, **changes)
    for argv, command in (
        (["verify", str(llama), str(kha)], "verify"),
        (["eval", "--candidate", str(kha), "--tasks", "arc_easy", "--output", str(tmp_path / "e")], "eval"),
        (["train", str(kha), "--output", str(tmp_path / "o")], "train"),
        (["serve", str(kha)], "serve"),
    ):
        assert message in one_line_error(capsys, argv, command)
    assert not (tmp_path / "o").exists()


# --- kha fold / inspect on knocks that do not fit ------------------------------------------------------------------
def test_fold_refuses_nan_and_inf_knocks(linear_kha, tmp_path, capsys):
    for bad in (float("nan"), float("inf")):

        def poison(knocks, value=bad):
            knocks["model.layers.1.self_attn.q_knock.weight"][0, 3] = value

        edit_knocks(linear_kha, poison)
        err = one_line_error(capsys, ["fold", str(linear_kha), str(tmp_path / "folded")], "fold")
        assert "NaN or infinite" in err and "q_knock" in err
        assert not (tmp_path / "folded").exists()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda k: k.__setitem__("model.layers.0.self_attn.v_knock.weight", torch.eye(8)), "has shape [8, 8]"),
        (lambda k: k.__setitem__("model.layers.0.self_attn.v_knock.weight", torch.ones(16)), "has shape [16]"),
        (lambda k: k.__setitem__("model.layers.0.self_attn.v_knock.weight", torch.ones(16, 8)), "has shape [16, 8]"),
        (lambda k: k.pop("model.layers.2.self_attn.k_knock.weight"), "is missing"),
        (lambda k: k.__setitem__("model.layers.7.self_attn.q_knock.weight", torch.eye(16)), "not described"),
    ],
)
def test_fold_and_inspect_refuse_knocks_that_do_not_fit_the_config(linear_kha, tmp_path, capsys, edit, message):
    edit_knocks(linear_kha, edit)
    assert message in one_line_error(capsys, ["fold", str(linear_kha), str(tmp_path / "folded")], "fold")
    assert not (tmp_path / "folded").exists()
    assert message in one_line_error(capsys, ["inspect", str(linear_kha)], "inspect")


def test_inspect_plot_needs_a_known_image_format(linear_kha, tmp_path, capsys):
    err = one_line_error(capsys, ["inspect", str(linear_kha), "--plot", str(tmp_path / "k.xyz")], "inspect")
    assert ".png" in err and not (tmp_path / "k.xyz").exists()
    err = one_line_error(capsys, ["inspect", str(linear_kha), "--plot", str(tmp_path / "no" / "k.png")], "inspect")
    assert "does not exist" in err


def test_inspect_plot_of_every_layer_differs_from_the_default_and_says_untrained(tmp_path, capsys):
    from kha_hf.conversion.knock_stats import plot_knocks

    model = KHAForCausalLM.from_base(tiny_base_model("llama"), knock="linear_v")  # 3 layers: a plot of 2 leaves one
    model.save_pretrained(tmp_path / "kha")
    import matplotlib.pyplot as plt

    titles = []
    original = plt.Figure.suptitle

    def record(self, text, **kwargs):
        titles.append(text)
        return original(self, text, **kwargs)

    plt.Figure.suptitle = record
    try:
        two = plot_knocks(tmp_path / "kha", tmp_path / "two.png", max_layers=2)
        every = plot_knocks(tmp_path / "kha", tmp_path / "every.png", max_layers=None)
    finally:
        plt.Figure.suptitle = original
    assert two.read_bytes() != every.read_bytes()
    assert "2 of 3 layers" in titles[0] and "3 of 3 layers" in titles[1]
    assert all("initial value" in t and "learned" not in t for t in titles)


# --- kha serve: bad starts --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "/etc"], "not a model folder"),
        (["serve", "{kha}", "--port", "70000"], "from 1 to 65535"),
        (["serve", "{kha}", "--port", "0"], "must be an integer"),
        (["serve", "{kha}", "--dtype", "float128"], "invalid choice"),
        (["serve", "{kha}", "--device", "cuda:7"], "cuda:7"),
        (["serve", "{kha}", "--host", "no-such-host.invalid"], "cannot resolve --host"),
        (["serve", "{kha}", "--host", "203.0.113.7"], "cannot listen on 203.0.113.7"),
        (["serve", "{kha}", "--max-new-tokens", "0"], "--max-new-tokens"),
        (["serve", "{kha}", "--request-timeout", "0"], "--request-timeout"),
    ],
)
def test_serve_bad_starts(tmp_path, capsys, argv, message):
    import torch

    if "cuda:7" in argv and torch.cuda.device_count() > 7:
        pytest.skip("this machine has that device")
    KHAForCausalLM.from_base(tiny_base_model("llama")).save_pretrained(tmp_path / "kha")
    save_tiny_tokenizer(tmp_path / "kha")  # else the missing tokenizer is what is refused
    argv = [a.format(kha=tmp_path / "kha") for a in argv]
    err = one_line_error(capsys, argv, "serve")
    assert message in err
    if "port is in use" not in err:
        assert "pick another --port" not in err


def test_serve_refuses_a_remote_code_folder_without_the_flag(tmp_path, capsys):
    from tests.serving.test_serve_guard import planted_remote_code_folder

    marker = tmp_path / "ran"
    planted_remote_code_folder(tmp_path / "evil", marker)
    err = one_line_error(capsys, ["serve", str(tmp_path / "evil")], "serve")
    assert "--trust-remote-code" in err and not marker.exists()


# --- kha train / eval: inputs that are not what they seem ---------------------------------------------------------
def test_training_data_that_is_not_a_regular_file(llama, tmp_path, capsys):
    fifo = tmp_path / "fifo.txt"
    os.mkfifo(fifo)
    for data in (str(fifo), "/dev/zero"):
        argv = ["train", str(llama), "--output", str(tmp_path / "o"), "--data", data]
        assert "is not a regular file or folder" in one_line_error(capsys, argv, "train")


@pytest.mark.parametrize(("args", "message"), [(["--seed", "-1"], "--seed"), (["--num-fewshot", "100000"], "128")])
def test_eval_numbers(llama, capsys, args, message):
    assert message in one_line_error(capsys, ["eval", "--candidate", str(llama), *args], "eval")


def test_a_kha_folders_tokenizer_never_runs_its_code(tmp_path):
    """--trust-remote-code is for base models of other architectures: with a KHA folder the tokenizer (its base
    model's) loads without remote code, so a planted tokenizer class does not run."""
    from kha_hf.checkpoint.loading import load_tokenizer

    folder = tmp_path / "kha"
    KHAForCausalLM.from_base(tiny_base_model("llama")).save_pretrained(folder)
    save_tiny_tokenizer(folder)
    marker = tmp_path / "ran"
    (folder / "tokenization_evil.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": ["tokenization_evil.Evil", None]}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    load_tokenizer(folder, trust_remote_code=True)
    assert not marker.exists()


def test_disk_full_names_the_destination_not_the_source(llama, tmp_path, capsys, monkeypatch):
    import errno
    import shutil

    def full(src, dst, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(src))

    monkeypatch.setattr(shutil, "copyfile", full)
    assert main(["convert", str(llama), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the shard progress bar
    assert err.startswith("kha convert: error: ")
    assert "no space left" in err and str(tmp_path) in err and "llama" not in err.split("writing")[1]
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".out.", ".kha-"))]


@pytest.fixture
def trainable(tmp_path) -> Path:
    """A tiny KHA model whose vocabulary covers the tiny tokenizer."""
    save_tiny_checkpoint(tmp_path / "trainable", knock="mlp_v")
    return tmp_path / "trainable"


def test_train_on_a_full_disk_is_one_line_and_keeps_nothing(trainable, tmp_path, capsys, monkeypatch):
    from safetensors import SafetensorError

    import kha_hf.modeling.modeling_kha as modeling

    def full(*args, **kwargs):
        raise SafetensorError(
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
        )

    monkeypatch.setattr(modeling.PreTrainedModel, "save_pretrained", full)
    (tmp_path / "text.txt").write_text("the quick brown fox jumps over the lazy dog. " * 60)
    argv = [
        "train",
        str(trainable),
        "--output",
        str(tmp_path / "o"),
        "--max-steps",
        "1",
        "--seq-len",
        "16",
        "--batch-size",
        "2",
        "--data",
        str(tmp_path / "text.txt"),
    ]
    assert main(argv) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "kha train: error: " in line]
    assert len(errors) == 1 and "Traceback" not in errors[0]
    assert "cannot save the trained model" in errors[0] or "no space left" in errors[0]
    assert not (tmp_path / "o").exists()


def test_train_into_a_read_only_folder_fails_before_training(llama, tmp_path, capsys, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
    import tempfile

    import kha_hf.training.train as train_module

    real_mkdtemp = tempfile.mkdtemp

    def mkdtemp(*args, dir=None, **kwargs):  # root may write anywhere: refuse as the kernel would for others
        if dir is not None and Path(dir) == locked:
            raise PermissionError(13, "Permission denied")
        return real_mkdtemp(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)

    def never(*args, **kwargs):
        raise AssertionError("training started")

    monkeypatch.setattr(train_module.KHATrainer, "train", never)
    err = one_line_error(capsys, ["train", str(llama), "--output", str(locked / "o")], "train")
    assert "cannot write next to" in err
