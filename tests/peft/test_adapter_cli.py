"""Knock adapter <-> KHA checkpoint from the command line (#29, item 2): `kha convert BASE DST --adapter DIR` (the
servable form of an adapter whose MLP knocks cannot merge) and `kha adapter KHA_DIR OUT` (the reverse).

The adapters are made by PEFT itself (`get_peft_model` + `save_pretrained`) with knocks moved off the identity, so
an output that kept identity knocks, or put a knock on the wrong layer or target, gives other logits. Reference:
the PeftModel of the stock base with that adapter, as PEFT loads it.
"""

from __future__ import annotations

import json

import pytest
import torch
from peft import AutoPeftModelForCausalLM, LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from kha_hf import KHAForCausalLM, KnockConfig
from kha_hf.cli import main
from tests.helpers import assert_close, save_tiny_checkpoint

IDS = torch.tensor([[3, 9, 27, 81, 5, 15, 45, 7, 21]])


def trained_adapter(base, out, knock="mlp_v", knock_layers=None, seed=3, scale=0.1, **extra):
    """A knock adapter of BASE with every knock moved off the identity, saved to OUT; its logits on IDS."""
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base), KnockConfig(knock=knock, knock_layers=knock_layers, **extra)
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".knock_sets." in name:
                param.add_(scale * torch.randn(param.shape, generator=gen))
    model.eval().save_pretrained(out)
    with torch.no_grad():
        return model(IDS).logits


@pytest.fixture
def base(tmp_path):
    save_tiny_checkpoint(tmp_path / "base", "llama")
    return tmp_path / "base"


@pytest.mark.parametrize(("family", "knock", "layers"), [("llama", "mlp_v", None), ("phi3", "linear_qkv", [1])])
def test_convert_with_an_adapter_gives_the_adapted_logits_and_back(family, knock, layers, tmp_path, capsys):
    base = tmp_path / "base"
    save_tiny_checkpoint(base, family)
    with torch.no_grad():
        stock = AutoModelForCausalLM.from_pretrained(base).eval()(IDS).logits
    expected = trained_adapter(base, tmp_path / "adapter", knock, layers)
    assert (expected - stock).abs().max() > 1e-3, "the adapter changes nothing: the test would prove nothing"

    assert main(["convert", str(base), str(tmp_path / "kha"), "--adapter", str(tmp_path / "adapter")]) == 0
    assert "trained, from" in capsys.readouterr().out
    kha = KHAForCausalLM.from_pretrained(tmp_path / "kha").eval()
    config = json.loads((tmp_path / "kha" / "config.json").read_text())
    assert config["knock_layers"] == (layers or config["knock_layers"])
    with torch.no_grad():
        assert_close(kha(IDS).logits, expected, atol=1e-5, what="KHA checkpoint vs PEFT adapter")

    # the reverse: the KHA checkpoint's knocks as an adapter that PEFT loads on the stock base
    assert main(["adapter", str(tmp_path / "kha"), str(tmp_path / "again"), "--base", str(base)]) == 0
    assert "a knock adapter of" in capsys.readouterr().out
    for reload in (
        lambda: PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "again"),
        lambda: AutoPeftModelForCausalLM.from_pretrained(tmp_path / "again"),
    ):
        with torch.no_grad():
            assert_close(reload().eval()(IDS).logits, expected, atol=1e-5, what="adapter from the KHA checkpoint")
    saved = load_file(tmp_path / "again" / "adapter_model.safetensors")
    assert saved and all(".knock_sets." in key for key in saved)


def test_the_knocks_keep_the_checkpoint_dtype(base, tmp_path):
    trained_adapter(base, tmp_path / "adapter")
    assert main(["convert", str(base), str(tmp_path / "kha"), "--adapter", str(tmp_path / "adapter")]) == 0
    model = KHAForCausalLM.from_pretrained(tmp_path / "kha")
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def _refused(argv, capsys, *needles):
    capsys.readouterr()  # what the test's own setup printed
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("kha "), err
    for needle in needles:
        assert needle in err, err
    return err


def test_adapter_of_another_family_or_size_is_refused_before_writing(base, tmp_path, capsys):
    save_tiny_checkpoint(tmp_path / "qwen3", "qwen3")
    trained_adapter(tmp_path / "qwen3", tmp_path / "qwen3-adapter")
    dst = tmp_path / "kha"
    _refused(["convert", str(base), str(dst), "--adapter", str(tmp_path / "qwen3-adapter")], capsys, "qwen3")
    save_tiny_checkpoint(tmp_path / "wide", "llama", hidden_size=128, head_dim=32)
    trained_adapter(tmp_path / "wide", tmp_path / "wide-adapter")
    _refused(["convert", str(base), str(dst), "--adapter", str(tmp_path / "wide-adapter")], capsys, "shape")
    trained_adapter(base, tmp_path / "three-layers")
    save_tiny_checkpoint(tmp_path / "deeper", "llama", num_hidden_layers=4)
    three = str(tmp_path / "three-layers")
    _refused(["convert", str(tmp_path / "deeper"), str(dst), "--adapter", three], capsys, "missing")
    assert not dst.exists() and not list(tmp_path.glob(".kha-*"))


def test_bad_adapter_folders_are_one_line(base, tmp_path, capsys):
    good = tmp_path / "good"
    trained_adapter(base, good)
    dst = str(tmp_path / "kha")

    def variant(name, edit_config=None, edit_tensors=None):
        folder = tmp_path / name
        folder.mkdir()
        config = json.loads((good / "adapter_config.json").read_text())
        if edit_config:
            edit_config(config)
        (folder / "adapter_config.json").write_text(json.dumps(config))
        tensors = load_file(good / "adapter_model.safetensors")
        if edit_tensors:
            edit_tensors(tensors)
        save_file(tensors, folder / "adapter_model.safetensors")
        return str(folder)

    first = sorted(load_file(good / "adapter_model.safetensors"))[0]
    cases = [
        (variant("nan", edit_tensors=lambda t: t[first].fill_(float("nan"))), "not finite"),
        (variant("int", edit_tensors=lambda t: t.update({first: t[first].to(torch.int32)})), "not finite floating"),
        (
            variant("extra", edit_tensors=lambda t: t.update({"base_model.model.lm_head.weight": torch.zeros(2)})),
            "not a knock",
        ),
        (variant("missing", edit_tensors=lambda t: t.pop(first)), "missing"),
        (variant("unknown-field", edit_config=lambda c: c.update({"evil": 1})), "unknown fields"),
        (variant("bad-preset", edit_config=lambda c: c.update({"knock": "evil"})), "unknown knock preset"),
        (variant("layers", edit_config=lambda c: c.update({"knock_layers": [10**12]})), "knock_layers"),
        (str(tmp_path / "nope"), "not a folder"),
    ]
    for folder, needle in cases:
        _refused(["convert", str(base), dst, "--adapter", folder], capsys, needle)

    lora = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(target_modules=["v_proj"]))
    lora.save_pretrained(tmp_path / "lora")
    _refused(["convert", str(base), dst, "--adapter", str(tmp_path / "lora")], capsys, "not a knock adapter")
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text((good / "adapter_config.json").read_text())
    torch.save({}, pickled / "adapter_model.bin")
    _refused(["convert", str(base), dst, "--adapter", str(pickled)], capsys, "pickle")
    secret = tmp_path / "secret.safetensors"
    secret.write_bytes((good / "adapter_model.safetensors").read_bytes())
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "adapter_config.json").write_text((good / "adapter_config.json").read_text())
    (linked / "adapter_model.safetensors").symlink_to(secret)
    _refused(["convert", str(base), dst, "--adapter", str(linked)], capsys)
    assert not (tmp_path / "kha").exists()


def test_modules_to_save_and_options_that_conflict(base, tmp_path, capsys):
    trained_adapter(base, tmp_path / "with-head", modules_to_save=["lm_head"])
    dst = str(tmp_path / "kha")
    _refused(["convert", str(base), dst, "--adapter", str(tmp_path / "with-head")], capsys, "modules_to_save")
    trained_adapter(base, tmp_path / "adapter")
    adapter = str(tmp_path / "adapter")
    _refused(["convert", str(base), dst, "--adapter", adapter, "--knock", "linear_v"], capsys, "--knock")
    _refused(["convert", str(base), dst, "--adapter", adapter, "--knock-layers", "0"], capsys, "--knock")
    _refused(["convert", str(base), dst, "--adapter", adapter, "--verify"], capsys, "--verify")


def test_adapter_command_refuses_what_is_not_a_finite_kha_checkpoint(base, tmp_path, capsys):
    _refused(["adapter", str(base), str(tmp_path / "out")], capsys, "not a KHA checkpoint")
    assert main(["convert", str(base), str(tmp_path / "kha")]) == 0
    capsys.readouterr()
    (tmp_path / "out").mkdir()
    _refused(["adapter", str(tmp_path / "kha"), str(tmp_path / "out")], capsys)  # exists, kha did not write it
    _refused(["adapter", str(tmp_path / "kha"), str(tmp_path / "kha" / "inside")], capsys)
    knocks = tmp_path / "kha" / "model-kha-knocks.safetensors"
    tensors = load_file(knocks)
    tensors[sorted(tensors)[0]].fill_(float("inf"))
    save_file(tensors, knocks)
    _refused(["adapter", str(tmp_path / "kha"), str(tmp_path / "out2")], capsys, "NaN or infinite")
    assert not (tmp_path / "out2").exists()


def test_the_adapter_folder_is_a_source(base, tmp_path, capsys):
    """DST may not lie inside the adapter folder, and --overwrite may not replace a folder holding it."""
    trained_adapter(base, tmp_path / "adapter")
    _refused(["convert", str(base), str(tmp_path / "adapter" / "sub"), "--adapter", str(tmp_path / "adapter")], capsys)
    assert main(["convert", str(base), str(tmp_path / "kha")]) == 0  # a folder kha wrote
    trained_adapter(base, tmp_path / "kha" / "adapter")
    inner = str(tmp_path / "kha" / "adapter")
    _refused(["convert", str(base), str(tmp_path / "kha"), "--adapter", inner, "--overwrite"], capsys, "contains")
    assert (tmp_path / "kha" / "adapter" / "adapter_model.safetensors").is_file()
