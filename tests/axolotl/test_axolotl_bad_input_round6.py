"""Base models whose config.json no model has, with `adapter: knock`: each is refused by Axolotl's validation in
one line of the plugin's (a ValueError pydantic wraps, naming the field and its value), before anything the config
sizes is built; never a traceback, never memory without bound (#58, items 4 and 7)."""

from __future__ import annotations

import json
import resource
import time

import pytest

pytestmark = pytest.mark.slow

GIGA_LAYERS = 10**9  # attention_layers' range, or Qwen3's layer_types, of this many: 22 GB before it was refused
RSS_BOUND_MB = 200  # the test process's peak RSS growth while the config is refused


@pytest.fixture
def llama(tmp_path):
    from tests.helpers import save_tiny_checkpoint

    save_tiny_checkpoint(tmp_path / "base", "llama")  # 3 layers
    return tmp_path / "base"


def _edit_config(folder, **fields):
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def _plugin_message(cfg: dict) -> str:
    """The one message of the plugin's validator that pydantic reports for CFG (a ValidationError, nothing else)."""
    from pydantic import ValidationError

    from tests.axolotl.runner import validate

    with pytest.raises(ValidationError) as err:
        validate(cfg)
    messages = [e["msg"] for e in err.value.errors() if e["type"] == "value_error"]
    assert len(messages) == 1, str(err.value)
    assert "\n" not in messages[0], messages[0]
    return messages[0].removeprefix("Value error, ")


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kilobytes on Linux


def _address_space_capped(headroom: int):
    """A context that caps this process's address space at its current size + HEADROOM bytes (RLIMIT_AS), so a
    regression fails with MemoryError instead of exhausting the machine."""
    import contextlib

    @contextlib.contextmanager
    def capped():
        with open("/proc/self/statm") as statm:
            size = int(statm.read().split()[0]) * resource.getpagesize()
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        cap = size + headroom if hard == resource.RLIM_INFINITY else min(size + headroom, hard)
        resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
        try:
            yield
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))

    return capped()


@pytest.mark.parametrize(
    "family, knock, edit",
    [
        # knock.layers: the knock check listed every attention layer of the model (attention_layers)
        ("llama", {"preset": "linear_v", "layers": [0]}, {}),
        # no layer_types: Qwen3Config lists one per layer itself, when the config is built
        ("qwen3", {"preset": "linear_v"}, {"layer_types": None}),
    ],
    ids=["llama-knock-layers", "qwen3-layer-types"],
)
def test_a_config_claiming_a_billion_layers_is_refused_quickly_in_bounded_memory(tmp_path, family, knock, edit):
    from tests.axolotl.runner import config
    from tests.helpers import save_tiny_checkpoint

    save_tiny_checkpoint(tmp_path / "base", family)
    _edit_config(tmp_path / "base", num_hidden_layers=GIGA_LAYERS, **edit)
    cfg = config(tmp_path, tmp_path / "base", adapter="knock", knock=knock)
    before, start = _peak_rss_mb(), time.monotonic()
    with _address_space_capped(1 << 30):
        message = _plugin_message(cfg)
    grown, seconds = _peak_rss_mb() - before, time.monotonic() - start
    print(f"{family}: refused in {seconds:.2f} s, peak RSS grew {grown:.1f} MB")
    assert message == (
        f"{tmp_path / 'base' / 'config.json'}: num_hidden_layers {GIGA_LAYERS} is beyond any model's (4096 at most)"
    )
    assert grown < RSS_BOUND_MB, f"peak RSS grew {grown:.0f} MB"
    assert seconds < 60, seconds


def test_a_model_type_that_is_not_a_string_is_refused_in_one_line(llama, tmp_path):
    from tests.axolotl.runner import config

    _edit_config(llama, model_type=["llama"])
    message = _plugin_message(config(tmp_path, llama, adapter="knock"))
    assert message == f"{llama / 'config.json'}: model_type must be a string, got a list", message


def test_a_config_nested_a_hundred_thousand_deep_is_refused_in_one_line(llama, tmp_path):
    from tests.axolotl.runner import config

    depth = 100_000
    (llama / "config.json").write_text('{"model_type": "llama", "x": ' + "[" * depth + "]" * depth + "}")
    message = _plugin_message(config(tmp_path, llama, adapter="knock"))
    assert message == f"{llama / 'config.json'} nests too deeply to be a model config", message


def test_a_layer_count_given_as_a_string_is_refused_in_one_line(llama, tmp_path):
    from tests.axolotl.runner import config

    _edit_config(llama, num_hidden_layers="3")
    message = _plugin_message(config(tmp_path, llama, adapter="knock"))
    assert message == f"{llama / 'config.json'}: num_hidden_layers must be a positive integer, got '3'", message


def test_qwen3_layer_types_of_the_wrong_length_are_refused_in_one_line(tmp_path):
    from tests.axolotl.runner import config
    from tests.helpers import save_tiny_checkpoint

    save_tiny_checkpoint(tmp_path / "base", "qwen3")
    layers = json.loads((tmp_path / "base" / "config.json").read_text())["num_hidden_layers"]
    _edit_config(tmp_path / "base", layer_types=["full_attention"] * (layers - 1))
    message = _plugin_message(config(tmp_path, tmp_path / "base", adapter="knock"))
    assert message == (
        f"{tmp_path / 'base' / 'config.json'}: layer_types lists {layers - 1} layers, num_hidden_layers is {layers}"
    ), message


def test_a_value_the_config_class_rejects_is_refused_in_one_line_in_its_words(llama, tmp_path):
    """What kha's checks leave to the family's config class (a strict-dataclass error, not a ValueError) is still
    one line of the validation, in transformers' words."""
    from tests.axolotl.runner import config

    _edit_config(llama, rms_norm_eps="tiny")
    message = _plugin_message(config(tmp_path, llama, adapter="knock"))
    assert message.startswith(f"{llama / 'config.json'}: Validation error for field 'rms_norm_eps'"), message
    assert "got str (value: 'tiny')" in message, message


def test_the_plugin_loads_a_knock_adapter_only_with_its_own_tensors(llama, tmp_path):
    """#61 item 1, the Axolotl path (`lora_model_dir`): a knock adapter file carrying the base model's own head
    (`lm_head.original_module.weight`, zeros) is refused before any weight changes."""
    import torch
    from axolotl.utils.dict import DictDefault
    from peft import get_peft_model
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from kha_hf import KnockConfig
    from kha_hf.integrations.axolotl import KHAPlugin

    adapter = get_peft_model(
        AutoModelForCausalLM.from_pretrained(llama), KnockConfig(knock="linear_v", modules_to_save=["lm_head"])
    )
    adapter.save_pretrained(tmp_path / "evil")
    path = tmp_path / "evil" / "adapter_model.safetensors"
    tensors = load_file(path)
    tensors["base_model.model.lm_head.original_module.weight"] = torch.zeros_like(
        tensors["base_model.model.lm_head.weight"]
    )
    save_file(tensors, path, metadata={"format": "pt"})
    base = AutoModelForCausalLM.from_pretrained(llama)
    # the parameter objects themselves: peft wraps modules in place, so names may change, the tensors may not
    before = [(param, param.detach().clone()) for param in base.parameters()]
    cfg = DictDefault({"adapter": "knock", "lora_model_dir": str(tmp_path / "evil")})
    with pytest.raises(ValueError, match="neither knocks nor its own copies"):
        KHAPlugin().load_adapter(base, cfg, inference=True)
    assert all(torch.equal(param, saved) for param, saved in before)
