"""Config validation and clear errors."""

import pytest
from transformers import GPT2Config, LlamaConfig

from kha_hf import KHAConfig
from tests.helpers import CACHE_KEY, FAMILIES, tiny_configs


def test_presets_set_the_knock_types():
    config = KHAConfig.from_base(tiny_configs()["qwen3"], knock="mlp_v_linear_qk")
    assert (config.knock_q, config.knock_k, config.knock_v) == ("linear", "linear", "mlp")
    assert config.knock_preset == "mlp_v_linear_qk"
    assert KHAConfig.from_base(tiny_configs()["llama"]).knock_v == "mlp"  # default: the paper's main setting
    custom = KHAConfig.from_base(tiny_configs()["llama"], knock="linear_v", knock_k="linear")
    assert (custom.knock_q, custom.knock_k, custom.knock_v) == ("none", "linear", "linear")
    assert custom.knock_preset is None


@pytest.mark.parametrize("family", FAMILIES)
def test_config_round_trips_and_keeps_base_fields(family, tmp_path):
    base = tiny_configs()[family]
    config = KHAConfig.from_base(base, knock="linear_qkv", knock_layers=[0, 2])
    config.save_pretrained(tmp_path)
    loaded = KHAConfig.from_pretrained(tmp_path)
    assert loaded.to_dict() == config.to_dict()
    assert loaded.to_base_config().to_dict() | {"transformers_version": None} == base.to_dict() | {
        "transformers_version": None
    }


def test_unsupported_base_family_names_the_supported_ones():
    with pytest.raises(ValueError, match="gpt2.*llama, mistral, ministral, qwen2"):
        KHAConfig.from_base(GPT2Config(n_layer=1, n_embd=32, n_head=2), knock="linear_v")
    with pytest.raises(ValueError, match="supports"):
        KHAConfig(base_model_type="no_such_family")
    # a multimodal wrapper is supported through its text decoder (tests/modeling/test_multimodal.py)
    assert KHAConfig(base_model_type="gemma3").knock_config.base_model_type == "gemma3_text"


def test_invalid_preset_and_target_type():
    with pytest.raises(ValueError, match="unknown knock preset 'mlp_everything'.*mlp_v"):
        KHAConfig.from_base(LlamaConfig(num_hidden_layers=2), knock="mlp_everything")
    with pytest.raises(ValueError, match="knock_q='gate' is not valid.*none, linear, mlp$"):
        KHAConfig.from_base(LlamaConfig(num_hidden_layers=2), knock_q="gate")  # the gate control is on V only
    with pytest.raises(ValueError, match="knock_init='orthogonal' is not valid.*identity, random"):
        KHAConfig.from_base(LlamaConfig(num_hidden_layers=2), knock_init="orthogonal")
    with pytest.raises(ValueError, match="knock_v='conv'"):
        KHAConfig.from_base(LlamaConfig(num_hidden_layers=2), knock_v="conv")


def test_knock_layers_out_of_range():
    with pytest.raises(ValueError, match=r"knock_layers \[4\] out of range.*2 layers"):
        KHAConfig.from_base(LlamaConfig(num_hidden_layers=2), knock_layers=[0, 4])
    with pytest.raises(ValueError, match="out of range"):
        KHAConfig.from_base(LlamaConfig(num_hidden_layers=2), knock_layers=[-1])


def test_already_kha_is_refused():
    with pytest.raises(ValueError, match="already a KHA config"):
        KHAConfig.from_base(KHAConfig.from_base(LlamaConfig(num_hidden_layers=2)))


@pytest.mark.parametrize("family", FAMILIES)
def test_every_base_field_round_trips(family):
    base = tiny_configs()[family].to_dict()
    kha = KHAConfig.from_base(tiny_configs()[family]).to_dict()
    file_keys = {"model_type", "architectures", "transformers_version"}
    missing = {k: v for k, v in base.items() if k not in file_keys and (k not in kha or kha[k] != v)}
    assert not missing, f"fields lost or changed: {missing}"


def test_use_cache_is_kept_and_honoured():
    import torch

    from kha_hf import KHAForCausalLM

    ids = torch.tensor([[1, 2, 3]])
    on = KHAForCausalLM(KHAConfig.from_base(tiny_configs()["llama"]))
    assert on.config.use_cache is True and getattr(on(ids), CACHE_KEY) is not None  # a KV cache, as stock Llama returns
    off_base = tiny_configs()["llama"]
    off_base.use_cache = False
    off = KHAForCausalLM(KHAConfig.from_base(off_base))
    assert off.config.use_cache is False and getattr(off(ids), CACHE_KEY) is None
    assert "use_cache" in off.config.to_dict() and off.config.to_dict()["use_cache"] is False


def test_public_classes_advertise_the_families_capabilities():
    import inspect

    from transformers import LlamaForCausalLM, Qwen3MoeForCausalLM

    from kha_hf import KHAForCausalLM, KHAModel
    from kha_hf.modeling.modeling_kha import family_classes

    for public in (KHAModel, KHAForCausalLM):
        assert public._supports_sdpa and public._supports_flash_attn and public._supports_flex_attn
        assert public._can_compile_fullgraph and public._supports_attention_backend
        assert public.supports_gradient_checkpointing
        assert "Qwen3DecoderLayer" in public._no_split_modules and "LlamaDecoderLayer" in public._no_split_modules
    assert KHAForCausalLM._tied_weights_keys == {"lm_head.weight": "model.embed_tokens.weight"}
    assert "input_ids" in inspect.signature(KHAForCausalLM.forward).parameters
    # each concrete family class keeps its family's own forward and layer names (the MoE forward differs)
    moe = family_classes("qwen3_moe")[2]
    assert moe.forward is Qwen3MoeForCausalLM.forward and moe._no_split_modules == ["Qwen3MoeDecoderLayer"]
    assert family_classes("llama")[2].forward is LlamaForCausalLM.forward
