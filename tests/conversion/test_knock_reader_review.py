"""The knock reader and fold after the checkpoint-reader refactor's review: what it read must still be what it
checked, float8 knocks and projections are checked like the others, and fold refuses what verify and gguf refuse."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from kha_hf.checkpoint.knock_reader import open_kha_checkpoint
from kha_hf.common.errors import KHAError
from tests.cli.test_bad_input import one_line_error
from tests.helpers import save_tiny_checkpoint

K0 = "model.layers.0.self_attn.k_knock.weight"
Q0 = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture
def kha(tmp_path):
    folder = tmp_path / "kha"
    save_tiny_checkpoint(folder, "llama", knock="linear_qkv")
    return folder


def _edit(folder, **tensors):
    path = folder / "model.safetensors"
    stored = load_file(path)
    stored.update(tensors)
    save_file(stored, path, metadata={"format": "pt"})


def test_a_shard_replaced_between_inspects_table_and_plot_is_refused_in_one_line(kha, tmp_path, capsys, monkeypatch):
    """inspect --plot reads the knocks twice from one opened checkpoint; the second read trusted the first's header
    (a RuntimeError traceback from get_tensor)."""
    import kha_hf.conversion.knock_stats as knock_stats

    statistics = knock_stats.knock_statistics

    def racing(opened):  # a writer (a trainer's save, rsync) replaces the shard between the two reads
        rows = statistics(opened)
        _edit(kha, **{K0: torch.zeros(16, 17)})
        return rows

    monkeypatch.setattr(knock_stats, "knock_statistics", racing)
    err = one_line_error(capsys, ["inspect", str(kha), "--plot", str(tmp_path / "k.png")], "inspect")
    assert f"knock tensor {K0} is now torch.float32 [16, 17], not the checked torch.float32 [16, 16]" in err
    assert not (tmp_path / "k.png").exists()


@pytest.mark.parametrize(
    "change, message",
    [
        ("dtype", "is now torch.float16 [16, 16], not the checked torch.float32 [16, 16]"),
        ("gone", "cannot be read since the folder was checked"),
        ("removed", "cannot be read since the folder was checked"),
    ],
)
def test_read_knocks_refuses_a_knock_that_changed_since_the_folder_was_opened(kha, change, message):
    opened = open_kha_checkpoint(kha)
    if change == "dtype":
        _edit(kha, **{K0: torch.eye(16, dtype=torch.float16)})
    elif change == "gone":  # the shard no longer holds that knock
        stored = load_file(kha / "model.safetensors")
        del stored[K0]
        save_file(stored, kha / "model.safetensors", metadata={"format": "pt"})
    else:
        (kha / "model.safetensors").unlink()
    with pytest.raises(KHAError) as err:
        opened.read_knocks()
    assert message in str(err.value) and "\n" not in str(err.value)


def test_float8_knocks_are_checked_for_nan_in_one_line(kha, tmp_path, capsys):
    """torch.isfinite has no float8 kernel: a float8 knock was a NotImplementedError traceback in inspect/fold."""
    nan = torch.eye(16)
    nan[3, 3] = float("nan")
    _edit(kha, **{K0: nan.to(torch.float8_e4m3fn)})
    for argv, command in (
        (["inspect", str(kha)], "inspect"),
        (["fold", str(kha), str(tmp_path / "out")], "fold"),
    ):
        err = one_line_error(capsys, argv, command)
        assert f"knock tensor {K0} holds 1 NaN or infinite values" in err
    assert not (tmp_path / "out").exists()


def test_float8_knocks_and_projections_fold(kha, tmp_path, capsys):
    from kha_hf.cli import main

    _edit(
        kha,
        **{
            K0: torch.eye(16).to(torch.float8_e4m3fn),
            Q0: load_file(kha / "model.safetensors")[Q0].to(torch.float8_e4m3fn),
        },
    )
    assert main(["inspect", str(kha)]) == 0
    assert main(["fold", str(kha), str(tmp_path / "out")]) == 0
    assert load_file(tmp_path / "out" / "model.safetensors")[Q0].dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("value", [float("nan"), 0.5])
def test_a_float8_adapter_knock_is_refused_in_one_line(tmp_path, value):
    """As PEFT loading refuses it (the knock's matmul has no float8 kernel); a NaN one was a NotImplementedError."""
    from kha_hf.peft.adapter_files import read_knock_adapter
    from tests.peft.test_adapter_cli import trained_adapter

    save_tiny_checkpoint(tmp_path / "base", "llama")
    trained_adapter(tmp_path / "base", tmp_path / "adapter")
    path = tmp_path / "adapter" / "adapter_model.safetensors"
    tensors = load_file(path)
    name = sorted(tensors)[0]
    bad = torch.full(tensors[name].shape, value).to(torch.float8_e4m3fn)
    save_file({**tensors, name: bad}, path)
    with pytest.raises(KHAError) as err:
        read_knock_adapter(tmp_path / "adapter")
    assert f"{name} is not finite floating point (torch.float8_e4m3fn)" in str(err.value)


def _config(folder, **values):
    import json

    data = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**data, **values}))


@pytest.mark.parametrize(
    "break_it, message",
    [
        ("layers", "config.json says 4 layers, the weights hold 3"),
        ("in_features", f"{Q0} has shape [64, 65]; the config gives [64, 64]"),
        ("int32", f"{Q0} is stored as torch.int32, not a floating-point tensor"),
        ("lm_head", "lm_head.weight has shape [299, 64]; the config gives [300, 64]"),
        ("nan", f"{Q0} holds 1 NaN or infinite values; refusing to fold it"),
    ],
)
def test_fold_refuses_a_folder_whose_config_does_not_describe_its_weights(kha, tmp_path, capsys, break_it, message):
    """kha fold wrote these as a stock checkpoint (exit 0) that gguf export, verify and serve refuse."""
    stored = load_file(kha / "model.safetensors")
    if break_it == "layers":
        _config(kha, num_hidden_layers=4, knock_layers=[0, 1, 2])
    elif break_it == "in_features":
        _edit(kha, **{Q0: torch.zeros(64, 65)})
    elif break_it == "int32":
        _edit(kha, **{Q0: torch.zeros(64, 64, dtype=torch.int32)})
    elif break_it == "lm_head":
        _edit(kha, **{"lm_head.weight": torch.zeros(299, 64)})
    else:
        nan = stored[Q0].clone()
        nan[0, 0] = float("nan")
        _edit(kha, **{Q0: nan})
    from kha_hf.cli import main

    capsys.readouterr()
    assert main(["fold", str(kha), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()  # a NaN is found while the shards are read: after the progress bar
    assert "Traceback" not in err and err.splitlines()[-1].startswith("kha fold: error: "), err
    assert message in err.splitlines()[-1]
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".kha-*"))
