"""`axolotl merge-lora` on a knock adapter: the plugin loads the trained adapter from `lora_model_dir` (never a fresh
one, whose identity knocks would "merge" into a copy of the base without a word) and Axolotl merges it through PEFT's
`merge_and_unload` (the `legacy` method, which the plugin picks)."""

from __future__ import annotations

import pytest
import torch
import yaml

from tests.helpers import assert_close

pytestmark = pytest.mark.slow
IDS = torch.tensor([[5, 17, 42, 9, 77, 3, 101, 250]])


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(IDS).logits


def _merge(cfg: dict, path):
    from axolotl.cli.merge_lora import do_cli

    path.write_text(yaml.safe_dump(cfg))
    do_cli(config=str(path))


def test_merge_lora_folds_the_trained_knocks_as_merge_and_unload_does(knock_run, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _merge(knock_run["cfg"], tmp_path / "merge.yml")
    merged = AutoModelForCausalLM.from_pretrained(knock_run["out"] / "merged", dtype=torch.float32)
    assert type(merged).__name__ == "LlamaForCausalLM"  # a stock model: nothing of kha-hf needed to load it
    assert not any("knock" in name for name, _ in merged.named_parameters())
    stock = AutoModelForCausalLM.from_pretrained(knock_run["base"], dtype=torch.float32)
    expected = PeftModel.from_pretrained(stock, knock_run["out"]).merge_and_unload()
    assert_close(_logits(merged), _logits(expected), what="axolotl merge-lora vs PEFT's merge_and_unload")
    # the trained model's own logits, within float32 rounding of the fold
    assert_close(_logits(merged), _logits(knock_run["model"]), atol=1e-4, what="merged vs trained in memory")
    base = AutoModelForCausalLM.from_pretrained(knock_run["base"], dtype=torch.float32)
    assert (_logits(merged) - _logits(base)).abs().max() > 1e-3, "the merged model is the base: no adapter merged"


def test_an_explicit_shard_by_shard_merge_is_refused_in_one_line(knock_run, tmp_path):
    with pytest.raises(ValueError) as err:
        _merge({**knock_run["cfg"], "merge_method": "memory_efficient"}, tmp_path / "merge.yml")
    assert str(err.value).startswith("merge_method 'memory_efficient' merges LoRA tensors only; a knock adapter")
    assert len(str(err.value).splitlines()) == 1


def test_an_mlp_knock_adapter_is_refused_in_one_line(tmp_path):
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from kha_hf import KnockConfig
    from tests.axolotl.runner import config
    from tests.helpers import save_tiny_checkpoint

    save_tiny_checkpoint(tmp_path / "base", "llama")
    adapter = get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), KnockConfig(knock="mlp_v"))
    adapter.save_pretrained(tmp_path / "out")
    cfg = config(tmp_path, tmp_path / "base", adapter="knock", knock={"preset": "mlp_v"})
    with pytest.raises(ValueError) as err:
        _merge(cfg, tmp_path / "merge.yml")
    assert "to_kha_model" in str(err.value) and len(str(err.value).splitlines()) == 1, str(err.value)
    assert not (tmp_path / "out" / "merged" / "config.json").exists()
