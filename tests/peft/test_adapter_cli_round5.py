"""`kha adapter`, safety round 5: a multimodal KHA checkpoint is refused in one line (item 7: a 14-frame traceback,
exit 1), and a local --base is recorded by its absolute path (item 12: a relative one, read from another directory,
made AutoPeftModelForCausalLM load whatever model of that size sat there)."""

from __future__ import annotations

import json
import os

import torch
from peft import AutoPeftModelForCausalLM

from kha_hf.cli import main
from tests.helpers import assert_close, save_tiny_checkpoint
from tests.multimodal_helpers import tiny_multimodal_model
from tests.peft.test_adapter_cli import IDS, _refused


def test_a_multimodal_kha_checkpoint_is_one_line_before_loading(tmp_path, capsys):
    tiny_multimodal_model("gemma3").save_pretrained(tmp_path / "base")
    assert main(["convert", str(tmp_path / "base"), str(tmp_path / "kha")]) == 0
    _refused(["adapter", str(tmp_path / "kha"), str(tmp_path / "out")], capsys, "is a multimodal KHA checkpoint")
    assert not (tmp_path / "out").exists()


def test_a_relative_base_is_recorded_absolute_and_loads_from_elsewhere(tmp_path, monkeypatch):
    save_tiny_checkpoint(tmp_path / "m" / "llama", "llama")
    assert main(["convert", str(tmp_path / "m" / "llama"), str(tmp_path / "kha")]) == 0
    monkeypatch.chdir(tmp_path)
    assert main(["adapter", "kha", "adapter", "--base", os.path.join("m", "llama")]) == 0
    recorded = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert recorded == str((tmp_path / "m" / "llama").resolve())
    elsewhere = tmp_path / "elsewhere"
    save_tiny_checkpoint(elsewhere / "m" / "llama", "llama", seed=5)  # another model of the same size
    monkeypatch.chdir(elsewhere)
    loaded = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter").eval()
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(tmp_path / "m" / "llama").eval()(IDS).logits
        assert_close(loaded(IDS).logits, expected, what="the recorded base, not the one under the new cwd")


def test_a_base_path_that_does_not_exist_is_refused(tmp_path, capsys):
    """The review's finding: `--base ./nosuch` and `--base ~/nosuch` were recorded as typed; a Hub id still is."""
    save_tiny_checkpoint(tmp_path / "llama", "llama")
    assert main(["convert", str(tmp_path / "llama"), str(tmp_path / "kha")]) == 0
    for base in ("./nosuch", "~/nosuch-kha-test", "../x/y/z"):
        _refused(["adapter", str(tmp_path / "kha"), str(tmp_path / "out"), "--base", base], capsys, "no such folder")
    assert main(["adapter", str(tmp_path / "kha"), str(tmp_path / "out"), "--base", "me/llama"]) == 0
    assert json.loads((tmp_path / "out" / "adapter_config.json").read_text())["base_model_name_or_path"] == "me/llama"
