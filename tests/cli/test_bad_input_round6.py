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
