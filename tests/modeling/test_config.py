"""Config validation and clear errors."""

import pytest
from transformers import GPT2Config, LlamaConfig

from kha_hf import KHAConfig
from tests.helpers import FAMILIES, tiny_configs


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
    with pytest.raises(ValueError, match="gpt2.*llama, mistral, qwen2, qwen3, qwen3_moe, mixtral"):
        KHAConfig.from_base(GPT2Config())
    with pytest.raises(ValueError, match="supports"):
        KHAConfig(base_model_type="gemma")


def test_invalid_preset_and_target_type():
    with pytest.raises(ValueError, match="unknown knock preset 'mlp_everything'.*mlp_v"):
        KHAConfig.from_base(LlamaConfig(num_hidden_layers=2), knock="mlp_everything")
    with pytest.raises(ValueError, match="knock_q='mlp' is not valid.*none, linear"):
        KHAConfig.from_base(LlamaConfig(num_hidden_layers=2), knock_q="mlp")
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
