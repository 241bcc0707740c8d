"""Refusals found by the review of the checkpoint-reader refactor: every tool answers a hostile folder in one line."""

from __future__ import annotations

import json

import pytest

from tests.cli.test_bad_input import one_line_error
from tests.helpers import save_tiny_checkpoint


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("base") / "llama"
    save_tiny_checkpoint(folder, "llama")
    return folder


def _kha(folder, **config):
    save_tiny_checkpoint(folder, "llama", knock="linear_qkv")
    if config:
        data = json.loads((folder / "config.json").read_text())
        data.update(config)
        (folder / "config.json").write_text(json.dumps(data))
    return folder


@pytest.mark.parametrize("value", [["llama"], {"a": 1}])
def test_a_model_type_that_is_not_a_string_is_refused_in_one_line(base, tmp_path, capsys, value):
    """Checkpoint.check() looked it up in FAMILIES: a TypeError traceback in verify (and kha train)."""
    kha = _kha(tmp_path / "kha", base_model_type=value)
    for argv, command in (
        (["verify", str(base), str(kha)], "verify"),
        (["inspect", str(kha)], "inspect"),
        (["fold", str(kha), str(tmp_path / "out")], "fold"),
    ):
        err = one_line_error(capsys, argv, command)
        assert f"base_model_type must be a string, got a {type(value).__name__}" in err, err
    assert not (tmp_path / "out").exists()
    stock = tmp_path / "stock"
    save_tiny_checkpoint(stock, "llama")
    data = json.loads((stock / "config.json").read_text())
    (stock / "config.json").write_text(json.dumps({**data, "model_type": value}))
    err = one_line_error(capsys, ["verify", str(stock), str(_kha(tmp_path / "kha2"))], "verify")
    assert f"model_type must be a string, got a {type(value).__name__}" in err, err


def _edit(folder, name, tensor):
    from safetensors.torch import load_file, save_file

    stored = load_file(folder / "model.safetensors")
    if tensor is None:
        del stored[name]
    else:
        stored[name] = tensor
    save_file(stored, folder / "model.safetensors", metadata={"format": "pt"})


K0 = "model.layers.0.self_attn.k_knock.weight"


@pytest.mark.parametrize(
    "name, tensor, message",
    [
        (K0, None, f"knock tensor {K0} is missing (1 missing in all)"),
        (K0, "int32", f"knock tensor {K0} is torch.int32, not a floating-point tensor"),
        (K0, (16, 17), f"knock tensor {K0} has shape [16, 17], expected [16, 16]"),
        ("model.layers.0.self_attn.q_proj.weight", (64, 65), "q_proj.weight has shape [64, 65]; the config gives"),
        ("lm_head.weight", (300, 65), "lm_head.weight has shape [300, 65]; the config gives [300, 64]"),
    ],
)
def test_verify_checks_kha_dirs_knocks_and_tensors_as_fold_does(base, tmp_path, capsys, name, tensor, message):
    """A missing or int32 knock verified as OK; a misshapen one, or a misshapen q_proj or lm_head, was a RuntimeError
    traceback from transformers."""
    import torch

    kha = _kha(tmp_path / "kha")
    if tensor == "int32":
        tensor = torch.eye(16, dtype=torch.int32)
    elif tensor is not None:
        tensor = torch.zeros(*tensor)
    _edit(kha, name, tensor)
    err = one_line_error(capsys, ["verify", str(base), str(kha)], "verify")
    assert message in err


def test_adapter_refuses_a_config_that_does_not_describe_the_weights(tmp_path, capsys):
    """kha adapter checked the knocks only: a fourth, random layer was built and its knocks saved (exit 0)."""
    kha = _kha(tmp_path / "kha", num_hidden_layers=4, knock_layers=[0, 1, 2])
    err = one_line_error(capsys, ["adapter", str(kha), str(tmp_path / "adapter")], "adapter")
    assert "config.json says 4 layers, the weights hold 3" in err
    assert not (tmp_path / "adapter").exists()


def test_a_weight_of_another_size_is_a_one_line_load_error_naming_it(tmp_path):
    """Where the folder's check does not see it (an architecture kha does not know, a caller that checked the folder
    itself), transformers' size mismatch was a RuntimeError saying only "look at the above report"."""
    import torch

    from kha_hf.checkpoint.loading import load_causal_lm
    from kha_hf.checkpoint.reader import Checkpoint, read_config
    from kha_hf.common.errors import KHAError

    folder = tmp_path / "llama"
    save_tiny_checkpoint(folder, "llama")
    _edit(folder, "lm_head.weight", torch.zeros(300, 65))
    with pytest.raises(KHAError) as err:
        load_causal_lm(folder, checked=Checkpoint(folder, read_config(folder), {}))  # a value nobody checked
    assert str(err.value) == (
        f"cannot load model {str(folder)!r}: lm_head.weight is stored with shape [300, 65]; the model its config.json "
        "describes has [300, 64]"
    )
