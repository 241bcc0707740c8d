"""`kha convert`, `kha fold`, `kha inspect` and `kha verify` on multimodal checkpoints (tiny random models of every
multimodal family, saved by stock transformers in each family's own on-disk layout): the knocks go into the text
decoder only, the shards are kept byte for byte, the processor comes along, and the image-text-to-text pipeline runs.
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForImageTextToText, AutoProcessor, pipeline

from kha_hf.cli import main
from kha_hf.common.errors import KHAError
from kha_hf.conversion import convert
from kha_hf.conversion.converter import KNOCKS_FILE
from kha_hf.conversion.fold import fold
from tests.helpers import assert_close, randomize_knocks, save_tiny_tokenizer
from tests.multimodal_helpers import (
    MULTIMODAL_FAMILIES,
    multimodal_inputs,
    multimodal_logits,
    save_gemma3_with_processor,
    text_decoder,
    tiny_image,
    tiny_multimodal_model,
)


def _digests(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.glob("*.safetensors")}


@pytest.mark.parametrize("family", MULTIMODAL_FAMILIES)
def test_convert_streams_a_multimodal_checkpoint_and_loads_exactly(family, tmp_path):
    base = tiny_multimodal_model(family)
    base.save_pretrained(tmp_path / "base")
    before = _digests(tmp_path / "base")
    result = convert(tmp_path / "base", tmp_path / "kha", knock="mlp_v_linear_qk", progress=False)
    assert _digests(tmp_path / "base") == before, "the source changed"
    shards = {name: digest for name, digest in _digests(tmp_path / "kha").items() if name != KNOCKS_FILE}
    assert sorted(shards.values()) == sorted(before.values()), "the base shards were not kept byte for byte"
    with safe_open(tmp_path / "kha" / KNOCKS_FILE, framework="pt") as f:
        names = list(f.keys())
    layers = base.config.text_config.num_hidden_layers
    assert len(names) == layers * 5 and names == result.knock_tensors  # q, k linear; v up/gate/down
    assert all("vision" not in n and "visual" not in n for n in names)
    config = json.loads((tmp_path / "kha" / "config.json").read_text())
    assert config["architectures"] == ["KHAForConditionalGeneration"] and config["base_model_type"] == family

    kha = AutoModelForImageTextToText.from_pretrained(tmp_path / "kha", attn_implementation="eager").eval()
    assert len([n for n, _ in kha.named_parameters() if "_knock." in n]) == len(names)
    inputs = multimodal_inputs(base.config)
    with torch.no_grad():
        assert_close(multimodal_logits(kha, inputs), multimodal_logits(base, inputs), what=family)
    # the knocks came from the file (identity), not from a fresh init: move one and reload
    randomize_knocks(kha)
    kha.save_pretrained(tmp_path / "trained")
    again = AutoModelForImageTextToText.from_pretrained(tmp_path / "trained", attn_implementation="eager").eval()
    with torch.no_grad():
        assert_close(multimodal_logits(again, inputs), multimodal_logits(kha, inputs), what=f"{family} trained")
    assert text_decoder(again).layers[0].self_attn.q_knock is not None


@pytest.mark.parametrize("family", MULTIMODAL_FAMILIES)
def test_fold_gives_the_stock_multimodal_model(family, tmp_path):
    base = tiny_multimodal_model(family)
    base.save_pretrained(tmp_path / "base")
    convert(tmp_path / "base", tmp_path / "kha", knock="linear_qkv", progress=False)
    kha = AutoModelForImageTextToText.from_pretrained(tmp_path / "kha", attn_implementation="eager").eval()
    randomize_knocks(kha, scale=0.2)
    kha.save_pretrained(tmp_path / "trained")
    fold(tmp_path / "trained", tmp_path / "folded", progress=False)
    config = json.loads((tmp_path / "folded" / "config.json").read_text())
    assert config["model_type"] == family and "auto_map" not in config
    folded = AutoModelForImageTextToText.from_pretrained(tmp_path / "folded", attn_implementation="eager").eval()
    assert type(folded).__module__.startswith("transformers.models.")
    assert not any("_knock" in n for n, _ in folded.named_parameters())
    inputs = multimodal_inputs(base.config)
    with torch.no_grad():
        got, expected = multimodal_logits(folded, inputs), multimodal_logits(kha, inputs)
        assert (expected - multimodal_logits(base, inputs)).abs().max() > 1e-3, "the knocks changed nothing"
    assert_close(got, expected, atol=1e-4, what=f"{family}: folded vs KHA")


@pytest.mark.parametrize("family", ["gemma3", "qwen2_5_vl"])
def test_inspect_and_verify_read_the_text_decoder(family, tmp_path, capsys):
    base = tiny_multimodal_model(family)
    base.save_pretrained(tmp_path / "base")
    save_tiny_tokenizer(tmp_path / "base")
    assert main(["convert", str(tmp_path / "base"), str(tmp_path / "kha"), "--knock", "linear_v"]) == 0
    assert main(["verify", str(tmp_path / "base"), str(tmp_path / "kha")]) == 0
    assert "verified: the KHA checkpoint reproduces its base model" in capsys.readouterr().out
    assert main(["inspect", str(tmp_path / "kha")]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.split()[:1] in (["0"], ["2"])]
    assert [row[:2] for row in rows] == [["0", "v"], ["2", "v"]], rows


def test_the_processor_comes_along_and_the_pipeline_runs(tmp_path):
    save_gemma3_with_processor(tmp_path / "base")
    result = convert(tmp_path / "base", tmp_path / "kha", knock="mlp_v", progress=False)
    assert result.missing == []
    for name in ("processor_config.json", "tokenizer.json", "chat_template.jinja"):
        assert (tmp_path / "kha" / name).read_bytes() == (tmp_path / "base" / name).read_bytes(), name
    processor = AutoProcessor.from_pretrained(tmp_path / "kha")
    text = "the fox <start_of_image> jumps"
    settings = dict(max_new_tokens=5, do_sample=False)
    outputs = {}
    for name in ("base", "kha"):
        model = AutoModelForImageTextToText.from_pretrained(tmp_path / name, attn_implementation="eager").eval()
        runner = pipeline("image-text-to-text", model=model, processor=processor)
        outputs[name] = runner(images=tiny_image(), text=text, generate_kwargs=settings)[0]["generated_text"]
    assert outputs["kha"] == outputs["base"] and outputs["kha"].startswith(text)
    # with trained knocks, the pipeline says what generate says
    randomize_knocks(model, scale=0.5)
    inputs = processor(images=tiny_image(), text=text, return_tensors="pt")
    with torch.no_grad():
        tokens = model.generate(**inputs, **settings)[0, inputs["input_ids"].shape[1] :]
    answer = runner(images=tiny_image(), text=text, generate_kwargs=settings)[0]["generated_text"]
    assert answer == text + processor.decode(tokens, skip_special_tokens=True)


def test_a_checkpoint_without_its_processor_converts_and_says_what_is_missing(tmp_path, capsys):
    tiny_multimodal_model("gemma3").save_pretrained(tmp_path / "base")
    result = convert(tmp_path / "base", tmp_path / "kha", progress=False)
    assert result.missing == ["processor"]
    assert (tmp_path / "kha" / KNOCKS_FILE).is_file() and (tmp_path / "kha" / "config.json").is_file()
    err = capsys.readouterr().err
    assert "has no image processor (preprocessor_config.json / processor_config.json)" in err


def test_a_multimodal_checkpoint_with_an_unsupported_text_decoder_is_refused_in_one_line(tmp_path):
    from transformers import LlavaConfig

    folder = tmp_path / "llava"
    folder.mkdir()
    config = LlavaConfig(text_config={"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2})
    (folder / "config.json").write_text(config.to_json_string())
    (folder / "model.safetensors").write_bytes(b"")  # never read: the config is refused first
    with pytest.raises(KHAError, match="text decoder of this llava model is 'gpt2'") as info:
        convert(folder, tmp_path / "out", progress=False)
    assert "\n" not in str(info.value) and not (tmp_path / "out").exists()


def test_a_multimodal_checkpoint_with_a_task_head_is_refused_not_converted(tmp_path):
    model = tiny_multimodal_model("gemma3")
    model.save_pretrained(tmp_path / "head")
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    config["architectures"] = ["Gemma3ForSequenceClassification"]
    (tmp_path / "head" / "config.json").write_text(json.dumps(config))
    with pytest.raises(KHAError, match="Gemma3ForSequenceClassification is not an image-text-to-text model KHA has"):
        convert(tmp_path / "head", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
