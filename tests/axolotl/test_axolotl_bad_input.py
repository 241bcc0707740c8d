"""Bad Axolotl configs with kha-hf's plugin: each fails in Axolotl's validation (before any weight loads), naming the
key and what is allowed, or in one line of the plugin's; and what Axolotl itself does without the plugin."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture
def llama(tmp_path):
    from tests.helpers import save_tiny_checkpoint

    save_tiny_checkpoint(tmp_path / "base", "llama")  # 3 layers
    return tmp_path / "base"


def _validation_error(cfg: dict) -> str:
    from pydantic import ValidationError

    from tests.axolotl.runner import validate

    with pytest.raises(ValidationError) as err:
        validate(cfg)
    return str(err.value)


def test_an_unknown_preset_names_the_key_and_the_presets(llama, tmp_path):
    from tests.axolotl.runner import config

    presets = (
        "'mlp_v', 'linear_v', 'linear_qkv', 'mlp_v_linear_qk', 'linear_q', 'linear_k', 'mlp_q', 'mlp_k' or 'mlp_qkv'"
    )
    for preset in ("mlp_everything", "gate_v"):  # gate_v: the paper's control, for from-scratch comparisons only
        message = _validation_error(config(tmp_path, llama, adapter="knock", knock={"preset": preset}))
        assert "knock.preset" in message
        assert presets in message, message


def test_a_misspelt_knock_key_is_named(llama, tmp_path):
    from tests.axolotl.runner import config

    message = _validation_error(config(tmp_path, llama, adapter="knock", knock={"presets": "linear_v"}))
    assert "knock.presets" in message and "Extra inputs are not permitted" in message, message


def test_a_layer_beyond_the_model_names_the_key_and_the_layers(llama, tmp_path):
    from tests.axolotl.runner import config

    message = _validation_error(
        config(tmp_path, llama, adapter="knock", knock={"preset": "linear_v", "layers": [1, 7]})
    )
    assert "knock.layers [7] are not attention layers of this llama model; allowed: 0-2" in message, message


def test_a_knock_block_without_adapter_knock_is_refused(llama, tmp_path):
    """Without `adapter: knock` the block would be ignored in silence (a LoRA run that meant to train knocks)."""
    from tests.axolotl.runner import config

    cfg = config(tmp_path, llama, adapter="lora", lora_r=4, lora_alpha=8, knock={"preset": "linear_v"})
    message = _validation_error(cfg)
    assert "the knock: block configures adapter: knock, and adapter is 'lora'" in message, message


def test_a_family_kha_does_not_support_is_named_with_the_supported_ones(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from kha_hf import SUPPORTED_BASE_MODEL_TYPES
    from tests.axolotl.runner import config
    from tests.helpers import save_tiny_tokenizer

    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=300)).save_pretrained(tmp_path / "gpt2")
    save_tiny_tokenizer(tmp_path / "gpt2")
    message = _validation_error(config(tmp_path, tmp_path / "gpt2", adapter="knock"))
    line = next(line for line in message.splitlines() if "adapter: knock" in line)
    assert "model_type 'gpt2'" in line and ", ".join(SUPPORTED_BASE_MODEL_TYPES) in line, line


def test_a_knock_adapter_on_a_kha_checkpoint_is_refused(tmp_path):
    from tests.axolotl.runner import config
    from tests.helpers import save_tiny_checkpoint

    save_tiny_checkpoint(tmp_path / "kha", "llama", knock="linear_v")
    message = _validation_error(config(tmp_path, tmp_path / "kha", adapter="knock"))
    assert "base_model is a KHA checkpoint, which has knocks already" in message, message


def test_without_the_plugin_axolotl_refuses_adapter_knock(llama, tmp_path):
    from tests.axolotl.runner import config

    message = _validation_error(config(tmp_path, llama, adapter="knock", plugins=None))
    assert "Adapter 'knock' is not built in and was not registered by a plugin" in message, message


def test_a_misspelt_plugin_module_is_logged_and_adapter_knock_still_refused(llama, tmp_path, capsys):
    """A plugin module that does not import: Axolotl logs "Failed to load plugin" and goes on (docs/guides/axolotl.md
    says so); with `adapter: knock` its own validation then refuses the adapter, so nothing trains without knocks."""
    from tests.axolotl.runner import config

    cfg = config(tmp_path, llama, adapter="knock", plugins=["kha_hf.integration.axolotl.KHAPlugin"])
    message = _validation_error(cfg)
    assert "Adapter 'knock' is not built in and was not registered by a plugin" in message
    assert "No module named 'kha_hf.integration'" in capsys.readouterr().out  # Axolotl prints the import error


def test_a_misspelt_plugin_class_stops_axolotl(llama, tmp_path):
    """A class name that the module lacks is not an ImportError: Axolotl's plugin loader raises it as it is."""
    from tests.axolotl.runner import config, validate

    with pytest.raises(AttributeError, match="has no attribute 'KHAPlugn'"):
        validate(config(tmp_path, llama, adapter="knock", plugins=["kha_hf.integrations.axolotl.KHAPlugn"]))


def test_a_kha_checkpoint_whose_config_lies_about_its_layers_is_refused_in_one_line(tmp_path):
    from kha_hf.common.errors import KHAError
    from tests.axolotl.runner import config, validate
    from tests.helpers import save_tiny_checkpoint

    save_tiny_checkpoint(tmp_path / "kha", "llama", knock="linear_v")
    config_file = tmp_path / "kha" / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "num_hidden_layers": 4}))
    with pytest.raises(KHAError) as err:
        validate(config(tmp_path, tmp_path / "kha", adapter="lora", lora_r=4, lora_alpha=8, lora_target_linear=True))
    assert len(str(err.value).splitlines()) == 1
    assert str(err.value).endswith("config.json says 4 layers, the weights hold 3 (layer indices 0..2)"), str(err.value)


def test_a_lora_adapter_in_lora_model_dir_is_refused_in_one_line(llama, tmp_path):
    """`adapter: knock` with `lora_model_dir` holding another method's adapter would go on with that adapter."""
    from axolotl.utils.dict import DictDefault
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from kha_hf.integrations.axolotl import KHAPlugin

    lora = LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM")
    get_peft_model(AutoModelForCausalLM.from_pretrained(llama), lora).save_pretrained(tmp_path / "lora")
    cfg = DictDefault({"adapter": "knock", "lora_model_dir": str(tmp_path / "lora")})
    with pytest.raises(ValueError) as err:
        KHAPlugin().load_adapter(AutoModelForCausalLM.from_pretrained(llama), cfg)
    assert str(err.value).startswith(f"adapter: knock, but lora_model_dir {tmp_path / 'lora'} holds a LORA adapter")
    assert len(str(err.value).splitlines()) == 1


def _kha_base(tmp_path, edit):
    """A tiny KHA checkpoint (linear_qkv) whose safetensors EDIT changed."""
    from safetensors.torch import load_file, save_file

    from tests.helpers import save_tiny_checkpoint

    save_tiny_checkpoint(tmp_path / "kha", "llama", knock="linear_qkv")
    path = tmp_path / "kha" / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    return tmp_path / "kha"


def _nan_knock(tensors):
    key = "model.layers.0.self_attn.k_knock.weight"
    tensors[key] = tensors[key] * float("nan")


@pytest.mark.parametrize(
    "edit, expected",
    [
        (_nan_knock, "k_knock.weight holds 256 NaN or infinite values"),
        (lambda t: t.pop("model.layers.0.self_attn.k_knock.weight"), "model.layers.0.self_attn.k_knock.weight"),
    ],
    ids=["nan-knock", "missing-knock"],
)
def test_a_kha_base_with_a_broken_knock_is_refused_in_one_line(tmp_path, edit, expected):
    """A NaN knock trained to an all-NaN model that Axolotl logged as loss 0; a missing one trained as the identity."""
    from kha_hf.common.errors import KHAError
    from tests.axolotl.runner import config, validate

    kha = _kha_base(tmp_path, edit)
    with pytest.raises(KHAError) as err:
        validate(config(tmp_path, kha))
    assert expected in str(err.value) and len(str(err.value).splitlines()) == 1, str(err.value)


def test_the_weights_folder_is_checked_even_when_base_model_config_names_a_sound_one(tmp_path):
    from kha_hf.common.errors import KHAError
    from tests.axolotl.runner import config, validate
    from tests.helpers import save_tiny_checkpoint

    save_tiny_checkpoint(tmp_path / "sound", "llama", knock="linear_qkv")
    broken = _kha_base(tmp_path, _nan_knock)
    with pytest.raises(KHAError, match="k_knock.weight holds 256 NaN or infinite values"):
        validate(config(tmp_path, broken, base_model_config=str(tmp_path / "sound")))


@pytest.mark.parametrize("layers", [["7"], [7.0], [], [True]])
def test_knock_layers_must_be_a_non_empty_list_of_integers(llama, tmp_path, layers):
    """ "7" and 7.0 were coerced to 7 after the layer check had skipped them; [] knocked nothing (PEFT's unclear
    error at load)."""
    from tests.axolotl.runner import config

    message = _validation_error(
        config(tmp_path, llama, adapter="knock", knock={"preset": "linear_v", "layers": layers})
    )
    assert "knock.layers" in message, message


def test_modules_to_save_naming_no_module_is_refused_in_one_line(llama):
    from axolotl.utils.dict import DictDefault
    from transformers import AutoModelForCausalLM

    from kha_hf.integrations.axolotl import KHAPlugin

    cfg = DictDefault({"adapter": "knock", "knock": {"preset": "linear_v", "modules_to_save": ["nonexistent"]}})
    with pytest.raises(ValueError, match=r"^modules_to_save \['nonexistent'\] names no module of this model$"):
        KHAPlugin().load_adapter(AutoModelForCausalLM.from_pretrained(llama), cfg)


def test_a_saved_adapter_other_than_the_knock_block_asks_for_is_used_with_a_warning(llama, tmp_path, monkeypatch):
    from axolotl.utils.dict import DictDefault
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from kha_hf import KnockConfig
    from kha_hf.integrations.axolotl import KHAPlugin, plugin

    get_peft_model(AutoModelForCausalLM.from_pretrained(llama), KnockConfig(knock="linear_qkv")).save_pretrained(
        tmp_path / "saved"
    )
    warnings = []
    monkeypatch.setattr(plugin.LOG, "warning", warnings.append)
    cfg = DictDefault({"adapter": "knock", "knock": {"preset": "linear_v"}, "lora_model_dir": str(tmp_path / "saved")})
    _, config = KHAPlugin().load_adapter(AutoModelForCausalLM.from_pretrained(llama), cfg)
    assert config.knock_types == {"q": "linear", "k": "linear", "v": "linear"}
    assert len(warnings) == 1 and "using the saved adapter" in warnings[0], warnings
