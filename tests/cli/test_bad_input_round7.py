"""Round 7 of the hostile-checkpoint attack (#59: the checkpoint room checks as it opens): what `kha train` (and every
tool that loads a model: serve, eval, verify) let through before, because only the knock-reading tools placed the
knocks, and a weight the config needs that the files lack. Each is one line, exit 2, nothing written."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.cli.test_bad_input import one_line_error
from tests.helpers import save_tiny_checkpoint, save_tiny_tokenizer

KNOCK = "model.layers.0.self_attn.k_knock.weight"


@pytest.fixture
def kha(tmp_path):
    """A converted KHA checkpoint (linear knocks on q, k and v) with a tokenizer."""
    from kha_hf.cli import main

    base = tmp_path / "base"
    save_tiny_checkpoint(base, "llama")
    save_tiny_tokenizer(base)
    assert main(["convert", str(base), str(tmp_path / "kha"), "--knock", "linear_qkv"]) == 0
    return tmp_path / "kha"


def _edit(folder, edit) -> None:
    """EDIT (a function of the name -> tensor dict) applied to whichever shard holds the knocks, index kept true."""
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = folder / index["weight_map"][KNOCK]
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != shard.name or k in tensors}
    index["weight_map"].update(dict.fromkeys(tensors, shard.name))
    index_path.write_text(json.dumps(index))


def _train_error(capsys, folder, tmp_path) -> str:
    argv = ["train", str(folder), "--output", str(tmp_path / "trained"), "--max-steps", "1"]
    err = one_line_error(capsys, argv, "train")
    assert not (tmp_path / "trained").exists()
    return err


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.__setitem__(KNOCK, torch.eye(8)), "has shape [8, 8], expected [16, 16]"),
        (lambda t: t.pop(KNOCK), f"knock tensor {KNOCK} is missing"),
        (lambda t: t.__setitem__(KNOCK, torch.eye(16, dtype=torch.int32)), "not a floating-point tensor"),
    ],
)
def test_train_refuses_knocks_that_do_not_fit_the_config(kha, tmp_path, capsys, edit, message):
    """Before: a traceback (a misshapen knock), or knocks initialised anew and trained without a word."""
    _edit(kha, edit)
    assert message in _train_error(capsys, kha, tmp_path)


def test_a_weight_the_model_needs_and_the_files_lack_is_refused(kha, tmp_path, capsys):
    """Before: `kha fold` wrote a checkpoint without lm_head.weight, and train drew it at random."""
    _edit(kha, lambda t: t.pop("lm_head.weight", None))
    index = json.loads((kha / "model.safetensors.index.json").read_text())
    if "lm_head.weight" in index["weight_map"]:  # the head sits in the base shard: drop it there
        shard = kha / index["weight_map"].pop("lm_head.weight")
        tensors = load_file(shard)
        tensors.pop("lm_head.weight")
        save_file(tensors, shard, metadata={"format": "pt"})
        (kha / "model.safetensors.index.json").write_text(json.dumps(index))
    expected = "does not describe the weights: 1 tensors missing ['lm_head.weight']"
    assert expected in _train_error(capsys, kha, tmp_path)
    assert expected in one_line_error(capsys, ["fold", str(kha), str(tmp_path / "folded")], "fold")
    assert not (tmp_path / "folded").exists()


def test_a_dropout_past_one_is_a_config_error(kha, tmp_path, capsys):
    """Before: about 100 lines of traceback from the first forward."""
    config = json.loads((kha / "config.json").read_text())
    (kha / "config.json").write_text(json.dumps({**config, "attention_dropout": 2.0}))
    assert "attention_dropout 2.0 is not a probability between 0 and 1" in _train_error(capsys, kha, tmp_path)


@pytest.mark.parametrize("value", [["llama"], {"a": 1}])
def test_convert_refuses_a_model_type_that_is_not_a_string(tmp_path, capsys, value):
    """Before: `TypeError: unhashable type` from the family lookup, exit 1."""
    base = tmp_path / "base"
    save_tiny_checkpoint(base, "llama")
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "model_type": value}))
    err = one_line_error(capsys, ["convert", str(base), str(tmp_path / "out")], "convert")
    assert f"model_type must be a string, got a {type(value).__name__}" in err
    assert not (tmp_path / "out").exists()
