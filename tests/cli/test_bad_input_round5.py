"""Safety round 5, item 16 (cosmetic): one-line errors that say the right thing."""

from __future__ import annotations

import pytest

from kha_hf import KHAConfig, KHAForCausalLM
from tests.cli.test_bad_input import one_line_error
from tests.helpers import tiny_base_model


def test_a_plot_path_ending_in_a_slash_is_called_a_folder(tmp_path, capsys):
    folder = tmp_path / "mlp"
    KHAForCausalLM.from_base(tiny_base_model("llama"), knock="mlp_v").save_pretrained(folder)
    err = one_line_error(capsys, ["inspect", str(folder), "--plot", f"{tmp_path}/dir.png/"], "inspect")
    assert "dir.png/: that names a folder" in err
    assert not (tmp_path / "dir.png").exists()


def test_an_adapter_with_other_tensors_is_refused_in_words_that_fit_eval_too(tmp_path):
    """The refusal is shared by kha convert --adapter and kha eval --adapter: it said "does not convert" to both."""
    from safetensors.torch import load_file, save_file

    from kha_hf import KHAError
    from kha_hf.peft.adapter_files import read_knock_adapter
    from tests.helpers import save_tiny_checkpoint
    from tests.peft.test_adapter_cli import trained_adapter

    save_tiny_checkpoint(tmp_path / "base", "llama")
    trained_adapter(tmp_path / "base", tmp_path / "adapter")
    path = tmp_path / "adapter" / "adapter_model.safetensors"
    tensors = load_file(path)
    tensors["base_model.model.lm_head.weight"] = tensors[sorted(tensors)[0]].clone()
    save_file(tensors, path)
    with pytest.raises(KHAError) as err:
        read_knock_adapter(tmp_path / "adapter")
    assert "is not a knock tensor: kha reads adapters that hold knocks only" in str(err.value)
    assert "convert" not in str(err.value)


def test_a_knock_preset_and_explicit_types_that_disagree_are_refused():
    with pytest.raises(ValueError, match=r"knock='mlp_v' means knock_q/k/v = none/none/mlp, but knock_q='linear'"):
        KHAConfig(base_model_type="llama", knock="mlp_v", knock_q="linear")
    agreeing = KHAConfig(base_model_type="llama", knock="linear_qkv", knock_q="linear")
    assert (agreeing.knock_q, agreeing.knock_k, agreeing.knock_v) == ("linear", "linear", "linear")
