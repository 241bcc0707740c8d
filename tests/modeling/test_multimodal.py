"""Multimodal models (image-text-to-text wrappers around a text decoder: Gemma 3, Qwen2.5-VL, Qwen3-VL and its MoE,
Mistral 3, Llama 4, Idefics3 / SmolVLM), each a tiny random model built as transformers' testers build theirs.

Per family, with images in the input: identity knocks are bit-exact to the stock transformers model; random knocks
equal a reference that knocks the stock text decoder's projections by hand (forward hooks, rows from
`expected_layouts.py`); the vision tower's parameters, classes and outputs are the stock ones; cached generation
with an image equals the reference's; save / load through the Auto classes, and remote code without kha_hf.
"""

from __future__ import annotations

import copy
import inspect
import json
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from kha_hf import KHAConfig, KHAForCausalLM, KHAForConditionalGeneration
from tests.helpers import assert_close, randomize_knocks, run_python
from tests.modeling.expected_layouts import expected_rows
from tests.modeling.test_families import _knock_hook
from tests.multimodal_helpers import (
    MULTIMODAL_FAMILIES,
    multimodal_config,
    multimodal_inputs,
    multimodal_logits,
    text_decoder,
    tiny_multimodal_model,
)

PRESETS = ("mlp_v", "linear_qkv", "mlp_v_linear_qk")


@pytest.mark.parametrize("family", MULTIMODAL_FAMILIES)
def test_identity_knocks_are_bit_exact_to_the_stock_model_with_images(family):
    base = tiny_multimodal_model(family)
    inputs = multimodal_inputs(base.config)
    with torch.no_grad():
        expected = multimodal_logits(base, inputs)
        other_image = {**inputs, "pixel_values": inputs["pixel_values"] + 1.0}
        assert (multimodal_logits(base, other_image) - expected).abs().max() > 1e-4, "the images change nothing"
    for preset in PRESETS:
        kha = KHAForConditionalGeneration.from_base(copy.deepcopy(base), knock=preset)
        assert isinstance(kha, KHAForCausalLM) and kha.config.base_model_type == family
        knocks = [name for name, _ in kha.named_parameters() if "_knock." in name]
        layers = base.config.text_config.num_hidden_layers
        assert len({name.split(".self_attn")[0] for name in knocks}) == layers, knocks
        with torch.no_grad():
            assert_close(multimodal_logits(kha, inputs), expected, what=f"{family}/{preset}")


def _knocked_reference(base, kha):
    """A copy of the stock model BASE whose text decoder projections apply KHA's knocks by hand (hooks)."""
    stock = copy.deepcopy(base)
    text_type = base.config.text_config.model_type
    placement = expected_rows(text_type, base.config.text_config)
    stock_layers, kha_layers = text_decoder(stock).layers, text_decoder(kha).layers
    for layer_idx in kha.config.knocked_layers:
        attention = kha_layers[layer_idx].self_attn
        knocks = {t: getattr(attention, f"{t}_knock") for t in "qkv"}
        for projection, rows in placement.items():
            module = getattr(stock_layers[layer_idx].self_attn, projection, None)
            if module is not None:
                module.register_forward_hook(_knock_hook(rows, knocks))
    return stock


@pytest.mark.parametrize("family", MULTIMODAL_FAMILIES)
def test_random_knocks_equal_a_reference_that_knocks_the_stock_text_decoder_by_hand(family):
    base = tiny_multimodal_model(family)
    inputs = multimodal_inputs(base.config)
    for preset in PRESETS:
        kha = KHAForConditionalGeneration.from_base(copy.deepcopy(base), knock=preset).eval()
        randomize_knocks(kha)
        reference = _knocked_reference(base, kha)
        with torch.no_grad():
            got, expected, unknocked = (multimodal_logits(m, inputs) for m in (kha, reference, base))
        assert (got - unknocked).abs().max() > 1e-3, f"{family}/{preset}: the knocks changed nothing"
        assert_close(got, expected, atol=2e-5, what=f"{family}/{preset}")


@pytest.mark.parametrize("family", MULTIMODAL_FAMILIES)
def test_the_vision_tower_and_projector_are_untouched(family):
    base = tiny_multimodal_model(family)
    kha = KHAForConditionalGeneration.from_base(copy.deepcopy(base), knock="linear_qkv").eval()
    randomize_knocks(kha)
    text_prefix = next(name for name, module in kha.named_modules() if module is text_decoder(kha))
    base_params = dict(base.named_parameters())
    for name, param in kha.named_parameters():
        if "_knock." in name:
            assert name.startswith(text_prefix + ".layers."), f"a knock outside the text decoder: {name}"
        else:
            assert torch.equal(param, base_params[name]), f"{name} changed"
    kha_modules = dict(kha.named_modules())
    for name, module in base.named_modules():
        if not text_prefix.startswith(name) and not name.startswith(text_prefix):  # vision tower, projector, head
            assert type(kha_modules[name]) is type(module), f"{name}: {type(kha_modules[name]).__name__}"
    inputs = multimodal_inputs(base.config)
    pixel_inputs = {k: v for k, v in inputs.items() if k in ("pixel_values", "image_grid_thw", "image_sizes")}
    with torch.no_grad():
        try:
            expected = base.get_image_features(**pixel_inputs, return_dict=True)
        except TypeError as err:  # Llama 4 on transformers 5.16.1 asks for the strategy its config names
            if "vision_feature_select_strategy" not in str(err):
                raise
            pixel_inputs["vision_feature_select_strategy"] = base.config.vision_config.vision_feature_select_strategy
            expected = base.get_image_features(**pixel_inputs, return_dict=True)
        got = kha.get_image_features(**pixel_inputs, return_dict=True)
    features = "pooler_output" if got.get("pooler_output") is not None else "last_hidden_state"
    got_features, expected_features = got[features], expected[features]
    if isinstance(got_features, (list, tuple)):
        got_features, expected_features = torch.cat(list(got_features)), torch.cat(list(expected_features))
    assert_close(got_features, expected_features, what=f"{family}: image features")


@pytest.mark.parametrize("family", [f for f in MULTIMODAL_FAMILIES if f != "llama4"])
def test_cached_generation_with_an_image_equals_the_reference(family):
    """Greedy decoding with the KV cache, image in the prompt, equals the hand-knocked stock model's. (Llama 4: its
    transformers 5.24 forward fails for every input, stock included: see multimodal_logits.)"""
    base = tiny_multimodal_model(family)
    kha = KHAForConditionalGeneration.from_base(copy.deepcopy(base), knock="mlp_v_linear_qk").eval()
    randomize_knocks(kha)
    reference = _knocked_reference(base, kha)
    inputs = multimodal_inputs(base.config)
    settings = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        got = kha.generate(**inputs, **settings)
        expected = reference.generate(**inputs, **settings)
        plain = base.generate(**inputs, **settings)
    assert torch.equal(got, expected), f"{family}: {got[:, -6:].tolist()} != {expected[:, -6:].tolist()}"
    assert got.shape[1] == inputs["input_ids"].shape[1] + 6 and not torch.equal(got, plain)


@pytest.mark.parametrize("family", MULTIMODAL_FAMILIES)
def test_save_and_load_through_the_auto_classes(family, tmp_path):
    kha = KHAForConditionalGeneration.from_base(tiny_multimodal_model(family), knock="mlp_v_linear_qk").eval()
    randomize_knocks(kha)
    kha.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == ["KHAForConditionalGeneration"] and saved["base_model_type"] == family
    assert saved["auto_map"]["AutoModelForImageTextToText"] == "modeling_kha.KHAForConditionalGeneration"
    assert saved["text_config"]["model_type"] == kha.config.text_config.model_type  # the family's own text config
    inputs = multimodal_inputs(kha.config)
    with torch.no_grad():
        expected = multimodal_logits(kha, inputs)
    for auto in (AutoModelForImageTextToText, AutoModelForCausalLM):
        loaded = auto.from_pretrained(tmp_path, attn_implementation="eager").eval()
        assert type(loaded) is type(kha)
        with torch.no_grad():
            assert_close(multimodal_logits(loaded, inputs), expected, what=f"{family} via {auto.__name__}")


def test_every_multimodal_family_loads_as_remote_code_without_kha_hf(tmp_path):
    expected = {}
    for family in MULTIMODAL_FAMILIES:
        kha = KHAForConditionalGeneration.from_base(tiny_multimodal_model(family), knock="mlp_v").eval()
        randomize_knocks(kha)
        kha.save_pretrained(tmp_path / family)
        inputs = multimodal_inputs(kha.config)
        with torch.no_grad():
            expected[family] = (inputs, multimodal_logits(kha, inputs))
    torch.save(expected, tmp_path / "expected.pt")
    script = textwrap.dedent(
        f"""
        import sys
        import torch
        from transformers import AutoModelForImageTextToText
        sys.path.insert(0, {str(tmp_path)!r})
        from logits import multimodal_logits
        for family, (inputs, logits) in torch.load({str(tmp_path / "expected.pt")!r}).items():
            model = AutoModelForImageTextToText.from_pretrained(
                {str(tmp_path)!r} + "/" + family, trust_remote_code=True, attn_implementation="eager"
            ).eval()
            assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
            with torch.no_grad():
                assert torch.equal(multimodal_logits(model, inputs), logits), family
            print("REMOTE_OK", family)
        """
    )

    from tests import multimodal_helpers

    (tmp_path / "logits.py").write_text("import torch\n\n" + inspect.getsource(multimodal_helpers.multimodal_logits))
    result = run_python(script, tmp_path)
    assert result.stdout.count("REMOTE_OK") == len(MULTIMODAL_FAMILIES), result.stdout[-2000:] + result.stderr[-3000:]


# --- bad input ----------------------------------------------------------------------------------------------------
def test_a_multimodal_model_whose_text_decoder_kha_does_not_support_is_refused_naming_it():
    from transformers import LlavaConfig

    config = LlavaConfig(text_config={"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2})
    with pytest.raises(ValueError, match=r"text decoder of this llava model is 'gpt2'"):
        KHAConfig.from_base(config)


def test_knock_layers_beyond_the_text_decoder_are_refused():
    with pytest.raises(ValueError, match=r"knock_layers \[3\] out of range: the model has 3 layers"):
        KHAConfig.from_base(multimodal_config("gemma3"), knock_layers=[3])
    config = KHAConfig.from_base(multimodal_config("gemma3"), knock_layers=[2, 1])
    assert config.knocked_layers == [1, 2] and config.knock_layers == [1, 2]


@pytest.mark.parametrize("model_type", ["siglip_vision_model", "whisper", "clip"])
def test_vision_and_audio_models_are_refused_in_one_line(model_type):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    with pytest.raises(ValueError, match=f"{model_type}") as info:
        KHAConfig.from_base(CONFIG_MAPPING[model_type]())
    assert "\n" not in str(info.value)


def test_a_text_only_model_is_not_a_conditional_generation_model():
    from tests.helpers import tiny_base_model

    with pytest.raises(ValueError, match="text-only model: load it with KHAForCausalLM"):
        KHAForConditionalGeneration.from_base(tiny_base_model("llama"))


@pytest.mark.parametrize("family", ["gemma3", "qwen2_5_vl", "idefics3"])
def test_from_pretrained_of_a_stock_checkpoint_with_knocks(family, tmp_path):
    base = tiny_multimodal_model(family)
    base.save_pretrained(tmp_path)
    kha = KHAForConditionalGeneration.from_pretrained(tmp_path, knock="linear_v", attn_implementation="eager").eval()
    assert kha.config.knock_v == "linear" and kha.config.knock_q == "none"
    assert text_decoder(kha).layers[0].self_attn.v_knock is not None
    inputs = multimodal_inputs(base.config)
    with torch.no_grad():
        assert_close(multimodal_logits(kha, inputs), multimodal_logits(base, inputs), what=family)
