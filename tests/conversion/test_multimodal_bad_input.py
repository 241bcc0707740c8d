"""Hostile and careless multimodal checkpoints: each is refused in one line before anything is written, and never
gets knocks anywhere but its text decoder (cases found by an attack on `kha convert` / `fold` / `serve`)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForImageTextToText

from kha_hf.cli import main
from kha_hf.common.errors import KHAError
from kha_hf.conversion import convert
from kha_hf.conversion.fold import fold
from kha_hf.modeling import KHAConfig
from tests.helpers import assert_close, randomize_knocks
from tests.multimodal_helpers import (
    MULTIMODAL,
    multimodal_config,
    multimodal_inputs,
    multimodal_logits,
    save_gemma3_with_processor,
    tiny_multimodal_model,
)


def _edit_config(folder, edit) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


def _one_line_refusal(run, match: str) -> None:
    with pytest.raises(KHAError, match=match) as info:
        run()
    assert "\n" not in str(info.value), str(info.value)


def test_a_wrapper_nested_as_its_own_text_decoder_is_refused(tmp_path):
    """mistral3 whose text_config says mistral3: the nested default (40 layers, head_dim 128) must not be knocked."""
    tiny_multimodal_model("mistral3").save_pretrained(tmp_path / "base")
    _edit_config(tmp_path / "base", lambda c: c["text_config"].update(model_type="mistral3"))
    _one_line_refusal(
        lambda: convert(tmp_path / "base", tmp_path / "out", progress=False), "text decoder .* is 'mistral3'"
    )
    assert not (tmp_path / "out").exists()
    config = multimodal_config("gemma3").to_dict()
    config["text_config"]["model_type"] = "gemma3"
    with pytest.raises(ValueError, match="text decoder of this gemma3 model is 'gemma3'"):
        KHAConfig.from_base(config)


def test_knocks_never_land_in_a_vision_tower_that_looks_like_the_text_decoder(tmp_path):
    """A Gemma 3 checkpoint whose text layers are gone and whose SigLIP tower has the text decoder's sizes."""
    text, vision = MULTIMODAL["gemma3"][1], MULTIMODAL["gemma3"][2]
    sizes = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=3, intermediate_size=64)
    original = dict(vision), dict(text)
    try:
        vision.update(sizes)
        text.update(num_key_value_heads=4)
        tiny_multimodal_model("gemma3").save_pretrained(tmp_path / "base")
    finally:
        vision.clear(), vision.update(original[0]), text.clear(), text.update(original[1])
    weights = load_file(tmp_path / "base" / "model.safetensors")
    kept = {k: v for k, v in weights.items() if not ("language_model." in k and ".layers." in k)}
    assert len(kept) < len(weights)
    save_file(kept, tmp_path / "base" / "model.safetensors", metadata={"format": "pt"})
    _one_line_refusal(
        lambda: convert(tmp_path / "base", tmp_path / "out", progress=False),
        "which of these layer stacks is the text",
    )
    assert not (tmp_path / "out").exists()


def test_weights_of_another_wrapper_than_the_config_names_are_refused(tmp_path):
    """Gemma 3 weights under a config relabelled mistral3 (stock, for convert; KHA, for fold)."""
    tiny_multimodal_model("gemma3").save_pretrained(tmp_path / "base")
    convert(tmp_path / "base", tmp_path / "kha", knock="linear_v", progress=False)
    _edit_config(tmp_path / "kha", lambda c: c.update(base_model_type="mistral3"))
    _one_line_refusal(lambda: fold(tmp_path / "kha", tmp_path / "folded", progress=False), "not those of the mistral3")
    assert not (tmp_path / "folded").exists()
    relabel = {"model_type": "mistral3", "architectures": ["Mistral3ForConditionalGeneration"]}
    _edit_config(tmp_path / "base", lambda c: c.update(relabel))
    _one_line_refusal(lambda: convert(tmp_path / "base", tmp_path / "out", progress=False), "not those of the mistral3")
    assert not (tmp_path / "out").exists()


def test_vision_tower_sizes_that_do_not_match_the_weights_are_refused(tmp_path):
    tiny_multimodal_model("gemma3").save_pretrained(tmp_path / "base")
    _edit_config(tmp_path / "base", lambda c: c["vision_config"].update(hidden_size=64))
    _one_line_refusal(
        lambda: convert(tmp_path / "base", tmp_path / "out", progress=False), "is stored with shape .*the config gives"
    )
    assert not (tmp_path / "out").exists()


def test_partial_fold_of_a_multimodal_model_stays_one(tmp_path):
    """`kha fold --partial` keeps the value MLP: the result is a KHAForConditionalGeneration with the same logits."""
    base = tiny_multimodal_model("gemma3")
    base.save_pretrained(tmp_path / "base")
    convert(tmp_path / "base", tmp_path / "kha", knock="mlp_v_linear_qk", progress=False)
    kha = AutoModelForImageTextToText.from_pretrained(tmp_path / "kha", attn_implementation="eager").eval()
    randomize_knocks(kha, scale=0.3)
    kha.save_pretrained(tmp_path / "trained")
    fold(tmp_path / "trained", tmp_path / "partial", partial=True, progress=False)
    config = json.loads((tmp_path / "partial" / "config.json").read_text())
    assert config["architectures"] == ["KHAForConditionalGeneration"]
    again = AutoModelForImageTextToText.from_pretrained(tmp_path / "partial", attn_implementation="eager").eval()
    inputs = multimodal_inputs(base.config)
    with torch.no_grad():
        expected = multimodal_logits(kha, inputs)
        assert (expected - multimodal_logits(base, inputs)).abs().max() > 1e-3, "the knocks changed nothing"
        assert_close(multimodal_logits(again, inputs), expected, atol=1e-4, what="partial fold")


@pytest.mark.parametrize(
    "family, sub_config, field",
    [
        ("gemma3", "text_config", "num_hidden_layers"),
        ("gemma3", "vision_config", "num_hidden_layers"),
        ("qwen2_5_vl", "vision_config", "depth"),  # Qwen-VL's vision towers count their blocks so
    ],
)
def test_absurd_layer_counts_are_refused_at_once(family, sub_config, field, tmp_path):
    """10^9 layers: refused from config.json (a subprocess with a deadline: without the check it would build them)."""
    tiny_multimodal_model(family).save_pretrained(tmp_path / "base")

    def huge(config):
        config[sub_config][field] = 10**9
        config[sub_config].pop("layer_types", None)

    _edit_config(tmp_path / "base", huge)
    command = [sys.executable, "-m", "kha_hf", "convert", str(tmp_path / "base"), str(tmp_path / "out")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0, result.stderr[-2000:]
    assert f"({sub_config}): {field} 1000000000 is beyond" in result.stderr
    assert not (tmp_path / "out").exists()


def test_a_kha_config_whose_text_config_is_not_an_object_is_one_line(tmp_path, capsys):
    tiny_multimodal_model("gemma3").save_pretrained(tmp_path / "base")
    convert(tmp_path / "base", tmp_path / "kha", knock="linear_v", progress=False)
    _edit_config(tmp_path / "kha", lambda c: c.update(text_config="x"))
    capsys.readouterr()
    for command in (["inspect", str(tmp_path / "kha")], ["fold", str(tmp_path / "kha"), str(tmp_path / "out")]):
        assert main(command) != 0
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "text_config must be an object" in err, err


@pytest.mark.parametrize("layers", [[True], ["1"], [1.0]])
def test_knock_layers_must_be_integers(layers):
    with pytest.raises(ValueError, match="knock_layers must be layer indices"):
        KHAConfig.from_base(multimodal_config("gemma3"), knock_layers=layers)
    with pytest.raises(ValueError, match="knock_layers must be layer indices"):
        KHAConfig.from_base(multimodal_config("gemma3").text_config, knock_layers=layers)


@pytest.mark.parametrize("where", ["top", "nested", "not_a_class", "tokenizer_config"])
def test_a_processor_that_needs_its_own_code_is_refused_by_convert_and_serve(where, tmp_path):
    """processor_config.json naming a class only a file in the folder defines (at its top, or in the image processor
    it nests, or a name transformers has that is no class), or tokenizer_config.json naming processor code while
    processor_config.json names no class (safety round 5 item 6): a KHA checkpoint never runs it."""
    save_gemma3_with_processor(tmp_path / "base")
    convert(tmp_path / "base", tmp_path / "kha", knock="linear_v", progress=False)
    for folder in (tmp_path / "base", tmp_path / "kha"):
        path = folder / "processor_config.json"
        config = json.loads(path.read_text())
        evil = {"auto_map": {"AutoProcessor": "evil.EvilProcessor"}, "processor_class": "EvilProcessor"}
        if where == "tokenizer_config":
            config.pop("processor_class", None)
            tokenizer_path = folder / "tokenizer_config.json"
            tokenizer_config = json.loads(tokenizer_path.read_text())
            tokenizer_config.update(auto_map={"AutoProcessor": "evil.EvilProcessor"})
            tokenizer_config.pop("processor_class", None)
            tokenizer_path.write_text(json.dumps(tokenizer_config))
        elif where == "nested":
            evil = {"auto_map": {"AutoImageProcessor": "evil.EvilIP"}, "image_processor_type": "EvilIP"}
            config["image_processor"].update(evil)
        else:
            config.update(evil if where == "top" else dict(evil, processor_class="logging"))
        path.write_text(json.dumps(config))
        (folder / "evil.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w')\n")
    assert main(["convert", str(tmp_path / "base"), str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()
    pytest.importorskip("fastapi")
    from kha_hf.serving.server import ServeLimits, check_serve_inputs

    _one_line_refusal(
        lambda: check_serve_inputs(str(tmp_path / "kha"), "cpu", "float32", False, ServeLimits(), {}),
        "processor needs its own code",
    )
    assert not (tmp_path / "ran").exists()


def test_verify_in_convert_does_not_advise_an_option_convert_lacks(tmp_path, capsys):
    tiny_multimodal_model("gemma3").save_pretrained(tmp_path / "base")  # no tokenizer files
    assert main(["convert", str(tmp_path / "base"), str(tmp_path / "out"), "--verify"]) != 0
    err = capsys.readouterr().err
    assert "has no tokenizer files" in err and "--tokenizer" not in err, err


def test_serving_a_kha_folder_without_a_tokenizer_is_one_line(tmp_path):
    pytest.importorskip("fastapi")
    from kha_hf.serving.server import ServeLimits, check_serve_inputs

    tiny_multimodal_model("gemma3").save_pretrained(tmp_path / "base")  # no tokenizer files
    convert(tmp_path / "base", tmp_path / "kha", knock="linear_v", progress=False)
    _one_line_refusal(
        lambda: check_serve_inputs(str(tmp_path / "kha"), "cpu", "float32", False, ServeLimits(), {}),
        "has no tokenizer files",
    )
