"""`adapter: knock` in Axolotl (kha_hf.integrations.axolotl.KHAPlugin): Axolotl's own training loop trains a knock
adapter on a stock model, and what it writes is a knock adapter that PEFT and `kha convert --adapter` load to the
model Axolotl had in memory, logit for logit in float32."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import assert_close

pytestmark = pytest.mark.slow
IDS = torch.tensor([[5, 17, 42, 9, 77, 3, 101, 250]])


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def _stock(base):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()


def test_axolotl_trains_only_the_knocks_and_the_loss_falls(knock_run):
    from tests.axolotl.runner import text_loss

    model, base = knock_run["model"], knock_run["base"]
    assert len(knock_run["losses"]) == 8
    assert text_loss(model, base) < text_loss(_stock(base), base)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".knock_sets.default." in name for name in trainable), trainable[:3]
    # 3 layers x (q, k, v) knocks of head_dim 16: what KnockConfig(knock="linear_qkv") builds on this model
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == 3 * 3 * 16 * 16
    written = json.loads((knock_run["out"] / "adapter_config.json").read_text())
    assert (written["peft_type"], written["knock"], written["base_model_type"]) == ("KNOCK", "linear_qkv", "llama")


def test_the_output_folder_reloads_exactly_with_peft(knock_run):
    from peft import PeftModel

    import kha_hf  # noqa: F401  (registers the KNOCK adapter type with peft)

    trained = _logits(knock_run["model"])
    reloaded = PeftModel.from_pretrained(_stock(knock_run["base"]), knock_run["out"]).eval()
    assert_close(_logits(reloaded), trained, what="PeftModel.from_pretrained(stock, Axolotl's output) vs in memory")
    assert not torch.equal(trained, _logits(_stock(knock_run["base"]))), "the trained knocks changed nothing"


def test_kha_convert_adapter_gives_the_same_model(knock_run):
    from kha_hf import KHAForCausalLM
    from kha_hf.cli import main

    dst = knock_run["root"] / "kha"
    assert main(["convert", str(knock_run["base"]), str(dst), "--adapter", str(knock_run["out"])]) == 0
    converted = KHAForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()
    assert_close(_logits(converted), _logits(knock_run["model"]), what="kha convert --adapter vs Axolotl's model")


def test_an_mlp_knock_adapter_on_qwen3_trains_and_reloads(tmp_path):
    """Another family and the default preset (mlp_v, no `knock:` block): q/k norms and biases on Qwen3."""
    from peft import PeftModel

    from tests.axolotl.runner import config, text_loss, train
    from tests.helpers import save_tiny_checkpoint

    save_tiny_checkpoint(tmp_path / "base", "qwen3")
    model, _, _ = train(config(tmp_path, tmp_path / "base", adapter="knock", max_steps=4))
    assert text_loss(model, tmp_path / "base") < text_loss(_stock(tmp_path / "base"), tmp_path / "base")
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    assert names and all(".v_proj.knock_sets.default.v_knock." in name for name in names), names[:3]
    reloaded = PeftModel.from_pretrained(_stock(tmp_path / "base"), tmp_path / "out").eval()
    assert_close(_logits(reloaded), _logits(model.eval()), what="qwen3 mlp_v adapter reloaded")
