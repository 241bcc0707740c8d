"""PEFT's conventions on KnockConfig (#48 items 2, 3, 5): `init_weights=False` (a seeded non-identity adapter, as
PEFT's tests use for every tuner), `layers_to_transform` / `layers_pattern` with PEFT's meaning, and a merge that
must knock the projection's bias too (Qwen2: q/k/v biases)."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel, get_peft_model

from kha_hf import KnockConfig
from tests.helpers import assert_close, tiny_base_model
from tests.peft.test_knock_adapter import IDS


def knocked_layers(model) -> set[int]:
    return {int(n.split("layers.")[1].split(".")[0]) for n, _ in model.named_parameters() if ".knock_sets." in n}


def test_init_weights_false_is_a_seeded_adapter_that_does_something(tmp_path):
    stock = tiny_base_model("llama").eval()
    with torch.no_grad():
        expected = stock(IDS).logits
    first = get_peft_model(tiny_base_model("llama"), KnockConfig(knock="mlp_v_linear_qk", init_weights=False)).eval()
    second = get_peft_model(tiny_base_model("llama"), KnockConfig(knock="mlp_v_linear_qk", init_weights=False)).eval()
    identity = get_peft_model(tiny_base_model("llama"), KnockConfig(knock="mlp_v_linear_qk")).eval()
    with torch.no_grad():
        moved = first(IDS).logits
        assert (moved - expected).abs().max() > 1e-3, "init_weights=False left the identity"
        assert torch.equal(second(IDS).logits, moved), "the perturbation is not seeded"
        assert torch.equal(identity(IDS).logits, expected), "init_weights=True must stay the identity"
    first.save_pretrained(tmp_path / "adapter")
    assert '"init_weights": false' in (tmp_path / "adapter" / "adapter_config.json").read_text()
    reloaded = PeftModel.from_pretrained(tiny_base_model("llama"), tmp_path / "adapter").eval()
    with torch.no_grad():
        assert torch.equal(reloaded(IDS).logits, moved), "a reload must give the saved knocks, not new noise"


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_init_weights_must_be_a_bool(value):
    with pytest.raises(ValueError, match="KnockConfig: init_weights must be True or False"):
        KnockConfig(init_weights=value)


def test_layers_to_transform_is_knock_layers():
    by_peft = get_peft_model(tiny_base_model("llama"), KnockConfig(knock="linear_v", layers_to_transform=1))
    by_kha = get_peft_model(tiny_base_model("llama"), KnockConfig(knock="linear_v", knock_layers=[1]))
    assert knocked_layers(by_peft) == knocked_layers(by_kha) == {1}
    both = KnockConfig(knock="linear_v", knock_layers=[0, 2], layers_to_transform=[2, 0], layers_pattern="layers")
    assert both.knock_layers == [0, 2]
    with pytest.raises(ValueError, match="knock_layers \\[0\\] and layers_to_transform \\[1\\] disagree"):
        KnockConfig(knock_layers=[0], layers_to_transform=[1])
    with pytest.raises(ValueError, match="layers_pattern 'h' is not supported"):
        KnockConfig(layers_pattern="h")


def test_a_merge_knocks_the_projection_bias_too():
    """Qwen2 has q/k/v biases (random here): a merge that folded the weights but not the biases moved the logits by
    0.126 on such a model; the fold rule b' = T^T b keeps them within float rounding, and unmerging restores them."""
    model = get_peft_model(tiny_base_model("qwen2"), KnockConfig(knock="linear_qkv", init_weights=False)).eval()
    v_proj = model.base_model.model.model.layers[0].self_attn.v_proj.base_layer
    assert v_proj.bias is not None and v_proj.bias.abs().max() > 0
    bias_before = v_proj.bias.detach().clone()
    with torch.no_grad():
        expected = model(IDS).logits
        model.merge_adapter()
        assert not torch.equal(v_proj.bias, bias_before), "the merge left the bias unknocked"
        assert_close(model(IDS).logits, expected, atol=1e-5, what="merged vs unmerged")
        model.unmerge_adapter()
        assert_close(model(IDS).logits, expected, atol=1e-5, what="unmerged again")
        assert_close(v_proj.bias, bias_before, atol=1e-6, what="bias restored")


def test_a_float8_knock_in_an_adapter_file_is_refused_in_one_line(tmp_path):
    """torch.isfinite has no float8 kernel: a hostile adapter with float8 knocks was a NotImplementedError traceback."""
    from safetensors.torch import load_file, save_file

    get_peft_model(tiny_base_model("llama"), KnockConfig(knock="linear_v")).save_pretrained(tmp_path)
    path = tmp_path / "adapter_model.safetensors"
    tensors = {key: t.to(torch.float8_e4m3fn) if "knock" in key else t for key, t in load_file(path).items()}
    save_file(tensors, path)
    with pytest.raises(ValueError, match="is not finite floating point \\(torch.float8_e4m3fn\\)"):
        PeftModel.from_pretrained(tiny_base_model("llama"), tmp_path)


@pytest.mark.parametrize(
    ("modules_to_save", "error"),
    [
        ([""], r"^modules_to_save \[''\] names no module of this model$"),
        (["nonexistent"], r"^modules_to_save \['nonexistent'\] names no module of this model$"),
        (["lm_head."], r"names no module"),
        (["*"], r"names no module"),
        # PEFT would train these in full and drop their knocks without a word, or fail about target_modules
        (
            ["layers.0.self_attn"],
            r"would train model\.layers\.0\.self_attn in full, and model\.layers\.0\.self_attn\.v_proj carries",
        ),
        (["0"], r"would train model\.layers\.0 in full"),
        (
            ["v_proj"],
            r"and model\.layers\.0\.self_attn\.v_proj carries a knock: a module takes knocks or full training",
        ),
        (["model"], r"would train model in full"),
        (["x" * 100_000], r"^modules_to_save \['x+\.\.\.x+'\] names no module of this model$"),  # not 100 k characters
    ],
)
def test_modules_to_save_that_names_nothing_or_a_knocked_module_is_refused(modules_to_save, error):
    with pytest.raises(ValueError, match=error):
        get_peft_model(tiny_base_model("llama"), KnockConfig(knock="mlp_v", modules_to_save=modules_to_save))


def test_modules_to_save_beside_the_knocks_still_trains_in_full():
    stock = get_peft_model(tiny_base_model("llama"), KnockConfig(knock="mlp_v"))
    model = get_peft_model(tiny_base_model("llama"), KnockConfig(knock="mlp_v", modules_to_save=["q_proj", "lm_head"]))
    assert knocked_layers(model) == knocked_layers(stock)  # every layer keeps its knock
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any(".q_proj.modules_to_save.default." in n for n in trainable)
    assert any("lm_head.modules_to_save.default." in n for n in trainable)


def test_a_task_head_name_on_a_causal_lm_is_refused():
    # only PEFT's own additions for a task type are exempt: a user's `score` on a causal LM would wrap nothing
    with pytest.raises(ValueError, match=r"modules_to_save \['score'\] names no module"):
        get_peft_model(tiny_base_model("llama"), KnockConfig(knock="mlp_v", modules_to_save=["score"]))


def test_the_refusal_names_the_module_that_holds_the_knock():
    config = KnockConfig(knock="mlp_v", knock_layers=[1], modules_to_save=["self_attn"])
    with pytest.raises(ValueError, match=r"would train model\.layers\.1\.self_attn in full, and model\.layers\.1\."):
        get_peft_model(tiny_base_model("llama"), config)


@pytest.mark.parametrize(
    ("config", "modules_to_save"),
    [({"knock_layers": [1]}, ["layers.0.self_attn"]), ({}, ["mlp"]), ({}, ["norm"]), ({}, ["lm_head"])],
)
def test_an_adapter_with_modules_to_save_reloads(tmp_path, config, modules_to_save):
    # a wrapped module's tensors may sit in its sub-modules (mlp.modules_to_save.default.down_proj.weight), and peft
    # matches an entry as a suffix of the module's name (norm: every *norm): both reload as they were saved
    model = get_peft_model(
        tiny_base_model("llama"), KnockConfig(knock="mlp_v", modules_to_save=modules_to_save, **config)
    )
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.add_(0.01)
        expected = model.eval()(IDS).logits
    model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(tiny_base_model("llama"), tmp_path / "adapter").eval()
    with torch.no_grad():
        assert torch.equal(reloaded(IDS).logits, expected)


@pytest.mark.parametrize(
    ("second", "error"),
    [
        (
            {"knock_layers": [1], "modules_to_save": ["layers.0.self_attn"]},
            r"and model\.layers\.0\.self_attn\.v_proj carries",
        ),
        ({"modules_to_save": ["base_layer"]}, r"\['base_layer'\] names no module"),
        ({"modules_to_save": ["original_module"]}, r"\['original_module'\] names no module"),
    ],
)
def test_a_second_adapter_cannot_train_what_the_first_knocks(second, error):
    model = get_peft_model(tiny_base_model("llama"), KnockConfig(knock="mlp_v", modules_to_save=["lm_head"]))
    with pytest.raises(ValueError, match=error):
        model.add_adapter("b", KnockConfig(knock="mlp_v", **second))


def test_the_task_heads_peft_adds_to_modules_to_save_are_no_mistake():
    from peft import TaskType
    from transformers import AutoModelForSequenceClassification

    base = tiny_base_model("llama", auto=AutoModelForSequenceClassification, num_labels=2)
    model = get_peft_model(base, KnockConfig(knock="mlp_v", task_type=TaskType.SEQ_CLS))  # adds classifier and score
    assert any("score.modules_to_save.default." in n for n, p in model.named_parameters() if p.requires_grad)
